"""Bad input refused in seconds: every input of a run is checked before Prefect, Ray or MLflow start and
before anything heavy is imported.

The CLI calls `preflight` first (flows/commands.py). It checks the recipe and its overrides (the
options and their combinations: dmd2/config.py), the model paths and the prompt file (the family's
checks, dmd2/family.py), the run id, the store URI, that the local outputs lie outside a file://
store, and the Ray, Prefect and MLflow addresses (a TCP connect, or a GET of the server's /health,
`REACH_TIMEOUT_S` at most each). Only the standard library and light project modules are imported
here, so a refusal costs no torch, prefect, ray or mlflow import, starts no server, creates no MLflow
run and writes nothing. Each refusal is a `ConfigError` naming the option (or file) and the fix;
the CLI prints it and exits 2.
"""

import os
import re
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from dmd2.config import ConfigError, DistillConfig
from flows.recipe import STORE_NAME, check_run_id, checked_config

REACH_TIMEOUT_S = 2.0  # per address: a server that does not answer in this long is refused
# infra.tracking's default (importing it loads mlflow); tests/reliability/test_bad_input.py checks they agree.
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
RAY_CLIENT_PORT = 10001  # `ray://host` without a port: Ray Client's default
DATABASE_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}  # SQLAlchemy URIs MLflow takes directly
# S3's rule for a bucket name, as infra.store.s3.validate_bucket has it (that module imports s3fs); the
# bad-input tests check that the two agree.
S3_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


@dataclass(frozen=True)
class Checked:
    """What the preflight established: the validated config, its family's name, the run id, and the store
    and MLflow addresses the run will use (defaults resolved)."""

    config: DistillConfig
    family: str
    run_id: str
    store_uri: str
    tracking_uri: str


def preflight(recipe: str | Path, overrides: list[str] | None = None, rollouts: int | None = None, *,
              run_id: str, store_uri: str | None = None, output_dir: str | Path = "outputs",
              cache_dir: str | Path | None = None, ray_address: str | None = None,
              tracking_uri: str | None = None) -> Checked:
    """Check every input of a distill run, as the distill flow takes them (None: the environment's, else
    the default); raises `ConfigError` naming the first bad one and its fix."""
    config, family = checked_config(recipe, overrides, rollouts)
    check_run_id(run_id)
    store_uri, store_option = _setting(store_uri, "--store", "DMD2_STORE", default_store_uri())
    check_store_uri(store_uri, store_option)
    check_outputs_apart(store_uri, Path(output_dir))
    if cache_dir is not None:
        check_creatable(Path(cache_dir), "--cache-dir")
    address, ray_option = _setting(ray_address, "--ray-address", "RAY_ADDRESS", "")
    check_ray_address(address, ray_option)
    if not address:
        check_local_cpus(config, os.cpu_count() or 1)
    check_prefect_api(os.environ.get("PREFECT_API_URL", ""))
    tracking_uri, tracking_option = _setting(tracking_uri, "--tracking-uri", "MLFLOW_TRACKING_URI",
                                             DEFAULT_TRACKING_URI)
    check_tracking_uri(tracking_uri, tracking_option)
    return Checked(config, family, run_id, store_uri, tracking_uri)


def preflight_evaluation(recipe: str | Path, overrides: list[str] | None, student: Path) -> tuple[DistillConfig, str]:
    """Check `dmd2 evaluate`'s inputs: the recipe (and its family's checks) and the student directory."""
    config, family = checked_config(recipe, overrides)
    if not student.is_dir():
        raise ConfigError(f"--student {student} is not a directory; give a run's exported student, e.g. "
                          "outputs/<run id>/student")
    return config, family


def default_store_uri() -> str:
    """The store a run uses without --store (the CLI's and the distill flow's): $DMD2_STORE, else ./artifacts."""
    return os.environ.get("DMD2_STORE", (Path.cwd() / "artifacts").as_uri())


def _setting(explicit: str | None, option: str, variable: str, default: str) -> tuple[str, str]:
    """A setting's value and the name to give it in an error: the option's, else the environment's, else
    the default."""
    if explicit is not None:
        return explicit, option
    if variable in os.environ:
        return os.environ[variable], variable
    return default, (f"{option} (default {default})" if default else option)


def check_store_uri(uri: str, option: str = "--store") -> None:
    """A store URI the artifact store opens: a creatable folder (file:// or a path), or s3://bucket/prefix."""
    scheme, separator, rest = uri.partition("://")
    if separator and "@" in rest.split("/", 1)[0]:  # refused before any message could show it
        raise ConfigError(f"{option}: the store URI must not embed credentials (user info before '@'); for S3 set "
                          "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE instead")
    if not separator:
        folder = uri
    elif scheme == "file":
        folder = rest
    elif scheme in ("s3", "s3a"):
        _check_s3_location(rest, option)
        return
    else:
        raise ConfigError(f"{option} {uri!r}: unsupported store scheme {scheme[:16]!r}; use file:///<folder> (or a "
                          "folder path) or s3://<bucket>/<prefix>")
    if not folder:
        raise ConfigError(f"{option} {uri!r} names no folder; give one, e.g. file:///data/artifacts")
    check_creatable(Path(os.path.expanduser(folder)), option)


def _check_s3_location(location: str, option: str) -> None:
    """The bucket and prefix of s3://bucket/prefix, by S3's naming rules (the bucket's existence and the
    credentials are the store's to check, when it first lists the bucket)."""
    bucket, _, prefix = location.partition("/")
    if not S3_BUCKET.fullmatch(bucket):
        raise ConfigError(f"{option}: {bucket[:64]!r} is not an S3 bucket name (3-63 of [a-z0-9.-], starting and "
                          "ending with a letter or digit); give s3://<bucket>/<prefix>")
    parts = prefix.strip("/").split("/") if prefix.strip("/") else []
    if not all(STORE_NAME.fullmatch(part) for part in parts):
        raise ConfigError(f"{option}: the prefix {prefix!r} is not a store key; use parts of [A-Za-z0-9._-] not "
                          "starting with '.' or '-', one '/' between them")


def check_creatable(folder: Path, option: str) -> None:
    """`folder` is a writable folder, or one this user could create (nothing is created here)."""
    folder = Path(os.path.abspath(folder))
    if folder.exists():
        if not folder.is_dir():
            raise ConfigError(f"{option} {folder} is a file, not a folder; choose a folder")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ConfigError(f"{option} {folder} is not writable by this user; fix its permissions or choose "
                              "another folder")
        return
    ancestor = next(parent for parent in folder.parents if parent.exists())
    if not ancestor.is_dir():
        raise ConfigError(f"{option} {folder} cannot be created: {ancestor} is a file, not a folder; choose "
                          "another folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {folder} cannot be created: {ancestor} is not writable by this user; "
                          "choose another folder or fix its permissions")


def check_outputs_apart(store_uri: str, output_dir: Path) -> None:
    """The local outputs must be creatable, and lie neither inside a file:// store nor around it."""
    check_creatable(output_dir, "--output-dir")
    scheme, separator, rest = store_uri.partition("://")
    if separator and scheme != "file":
        return
    root = Path(os.path.abspath(os.path.expanduser(rest if separator else store_uri))).resolve()
    outputs = output_dir.resolve()
    if outputs == root or root in outputs.parents or outputs in root.parents:
        raise ConfigError(f"--output-dir {output_dir} and --store file://{root} overlap; the store keeps its own "
                          "copy of the student, so give them separate folders (defaults: ./outputs, ./artifacts)")


def check_ray_address(address: str, option: str = "--ray-address") -> None:
    """A Ray cluster to join that answers: `host:port` (its GCS) or `ray://host[:port]` (Ray Client); `auto`
    and `local` are Ray's own (a running local cluster, a new one); empty: a local Ray is started."""
    if address in ("", "auto", "local"):
        return
    scheme, separator, rest = address.partition("://")
    fix = ("give auto, host:port (the head's GCS, port 6379 by default) or ray://host:10001 (Ray Client), or "
           "unset it to start a local Ray")
    if separator and scheme != "ray":
        raise ConfigError(f"{option} {address!r}: unsupported scheme {scheme!r}; {fix}")
    host, port = _host_port(rest if separator else address, RAY_CLIENT_PORT if separator else None)
    if not host or port is None:
        raise ConfigError(f"{option} {address!r} is not host:port; {fix}")
    _check_reachable(host, port, f"{option} {address!r}", "start the cluster (ray start --head) or fix the address")


def check_local_cpus(config: DistillConfig, cpus: int) -> None:
    """Refuse CPUs per rank that the local Ray (one node of this machine's ``cpus``) could never give every rank:
    Ray would wait for them in vain. Rank i of every group shares bundle i (infra/trainers/cluster.py)."""
    cluster, train = config.cluster, config.train
    if cluster.cpus_per_rank is None:
        return  # the default is a share that fits
    groups = 2 if train.loss_type == "dmd2" else 1  # the critic, beside the actor
    bundle = cluster.cpus_per_rank * groups
    placeable = 1 if cluster.placement_strategy == "STRICT_SPREAD" else int(cpus / bundle + 1e-9)
    if placeable < train.world_size:
        raise ConfigError(
            f"[train] world_size = {train.world_size} with [cluster] cpus_per_rank = {cluster.cpus_per_rank:g} needs "
            f"{train.world_size} bundles of {bundle:g} CPUs ({groups} group(s) per rank, "
            f"{cluster.placement_strategy}), but a local Ray on this machine has {cpus} CPUs (it holds {placeable}): "
            "lower either, or unset [cluster] cpus_per_rank (the default shares the machine's CPUs), or join a "
            "larger cluster with --ray-address / RAY_ADDRESS")


def check_prefect_api(url: str) -> None:
    """PREFECT_API_URL, when set, must be a Prefect server's API that answers its /health (unset: each
    flow run starts a temporary local server)."""
    if not url:
        return
    if urlsplit(url).scheme not in ("http", "https"):
        raise ConfigError(f"PREFECT_API_URL {_public(url)!r} is not an http(s) URL; set it to the server's API, "
                          "e.g. http://127.0.0.1:4200/api, or unset it")
    _check_health(url, "PREFECT_API_URL", "start the server (prefect server start) or fix PREFECT_API_URL; it "
                                          "ends in /api, e.g. http://127.0.0.1:4200/api")


def check_tracking_uri(uri: str, option: str = "--tracking-uri") -> None:
    """An MLflow tracking URI the run can open: sqlite:///<file> in an existing writable folder, an http(s)
    MLflow server that answers its /health, a file:// folder (or a path), or a database server that answers."""
    scheme = urlsplit(uri).scheme
    if scheme == "sqlite":
        _check_sqlite(uri, option)
    elif scheme in ("http", "https"):
        _check_health(uri, f"{option} {_public(uri)!r}", "start the MLflow server (mlflow server) or fix the URI")
    elif scheme in ("", "file"):
        folder = uri.removeprefix("file://") if scheme else uri
        check_creatable(Path(os.path.expanduser(folder)), option)
    elif (database := scheme.split("+")[0]) in DATABASE_PORTS:
        parts = urlsplit(uri)
        _check_reachable(parts.hostname or "localhost", parts.port or DATABASE_PORTS[database],
                         f"{option} {_public(uri)!r}", "start the database or fix the URI")
    else:
        raise ConfigError(f"{option} {_public(uri)!r}: unsupported tracking URI scheme {scheme!r}; use "
                          "sqlite:///<file>.db, http(s)://<MLflow server>, file:///<folder> or a database URI "
                          f"({', '.join(DATABASE_PORTS)})")


def _check_sqlite(uri: str, option: str) -> None:
    """sqlite:///relative.db or sqlite:////absolute.db: SQLite creates the file, never its folder."""
    if not uri.startswith("sqlite:///") or not uri.removeprefix("sqlite:///"):
        raise ConfigError(f"{option} {uri!r} names no database file; write sqlite:///mlflow.db (in the working "
                          "folder) or sqlite:////absolute/path/mlflow.db")
    database = Path(os.path.abspath(uri.removeprefix("sqlite:///")))
    if not database.parent.is_dir():
        raise ConfigError(f"{option} {uri!r}: the folder {database.parent} of the database does not exist; "
                          f"create it (mkdir -p {database.parent}) or choose another path")
    if database.exists() and not database.is_file():
        raise ConfigError(f"{option} {uri!r}: {database} is not a file; choose another database path")
    if not os.access(database if database.exists() else database.parent, os.W_OK):
        raise ConfigError(f"{option} {uri!r}: {database} is not writable by this user; fix its permissions or "
                          "choose another path")


def _host_port(text: str, default_port: int | None) -> tuple[str | None, int | None]:
    """`host:port` (an IPv6 host in brackets) -> (host, port); (None, None) when it does not parse."""
    try:
        parts = urlsplit(f"//{text}")
        return parts.hostname, parts.port if parts.port is not None else default_port
    except ValueError:  # a port that is not a number in 0..65535
        return None, None


def _check_reachable(host: str, port: int, what: str, fix: str) -> None:
    try:
        socket.create_connection((host, port), timeout=REACH_TIMEOUT_S).close()
    except OSError as error:
        raise ConfigError(f"{what}: nothing answers at {host}:{port} ({error.strerror or error}); {fix}") from None


def _check_health(url: str, what: str, fix: str) -> None:
    """GET <url>/health: any answer but a server error or a missing page means the server is there (401
    and 403 too: credentials are the client's to send, and /health needs none on MLflow and Prefect)."""
    health = _public(url).rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(health, timeout=REACH_TIMEOUT_S):
            return
    except urllib.error.HTTPError as error:
        if error.code in (401, 403):
            return
        raise ConfigError(f"{what}: {health} answered HTTP {error.code}; {fix}") from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        raise ConfigError(f"{what}: nothing answers at {health} ({reason}); {fix}") from None


def _public(url: str) -> str:
    """`url` without its user info (`https://user:token@host` -> `https://host`): fit to show and to probe."""
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]).geturl() if "@" in parts.netloc else url
