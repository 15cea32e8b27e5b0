"""Secrets stay secret: planted credentials appear in nothing a run records or shows; only safetensors
and JSON are loaded from a store; run ids stay below the store root; the local Ray wants its token.

Everything is real: moto's S3 server checking signatures against its IAM, an `mlflow server` process on
sqlite behind a gate that wants HTTP basic auth (as an authenticating proxy in front of MLflow would),
Prefect's test server, a local Ray started by the project.
"""

import asyncio
import base64
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import mlflow
import pytest
import ray
import torch
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.logging.handlers import APILogHandler
from safetensors.torch import load_file

from dmd2.config import ConfigError
from dmd2.families.digits.family import DigitsFamily
from dmd2.families.digits.model import build_digits_unet
from dmd2.model import load_pretrained
from flows.cli import main as cli
from flows.distill import distill
from flows.recipe import check_run_id
from infra.store import ArtifactStore, RunLease
from infra.tracking.registry import MODEL_ID_TAG
from infra.trainers import cluster
from infra.trainers.cluster import default_token_file, ensure_ray, prepare_token_auth
from tests.flows.conftest import write_recipe
from tests.infra.conftest import BUCKET, REGION
from tests.reliability.mlflow_gate import MLFLOW_SETTINGS, BasicAuthGate, mlflow_server  # noqa: F401 (a fixture)


def restore_after_test(monkeypatch, *names: str) -> None:
    """Put back `names` as they were once the test ends, whatever the code under test sets them to."""
    for name in names:
        monkeypatch.setenv(name, "")  # records the value to restore ...
        monkeypatch.delenv(name)  # ... and starts the test without one


def moto_credentials() -> tuple[str, str]:
    """A fresh access key of an IAM user allowed all of S3; moto makes up its secret."""
    iam = boto3.client("iam", region_name=REGION)
    user = f"dmd2-{uuid.uuid4().hex[:8]}"
    iam.create_user(UserName=user)
    iam.put_user_policy(UserName=user, PolicyName="store", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    return key["AccessKeyId"], key["SecretAccessKey"]


# -- 1. credentials never recorded ---------------------------------------------------------------------


async def prefect_records() -> dict[str, str]:
    """Every flow run, task run, log and artifact the Prefect server holds, as JSON text."""
    async def every(read) -> list:
        found, offset = [], 0
        while page := await read(limit=200, offset=offset):
            found += page
            offset += len(page)
        return found

    await APILogHandler.aflush()  # the run's last log lines are still on their way
    async with get_client() as client:
        return {kind: "\n".join(item.model_dump_json() for item in await every(read)) for kind, read in
                [("flow runs", client.read_flow_runs), ("task runs", client.read_task_runs),
                 ("logs", client.read_logs), ("artifacts", client.read_artifacts)]}


def mlflow_records(client: MlflowClient, mlflow_run_id: str, model_name: str, folder: Path) -> dict[str, str]:
    """The run's params, tags and every artifact's bytes; the registered versions' tags and their model's files."""
    run = client.get_run(mlflow_run_id)
    records = {"params": json.dumps(run.data.params), "tags": json.dumps(run.data.tags),
               "metric names": json.dumps(sorted(run.data.metrics))}
    client.download_artifacts(mlflow_run_id, "", str(folder / "run"))
    for version in client.search_model_versions(f"name = '{model_name}'"):
        records[f"version {version.version}"] = json.dumps([version.tags, version.source, version.description])
        logged = client.get_logged_model(version.tags[MODEL_ID_TAG])  # the registry keeps no model id here
        records[f"logged model {version.version}"] = json.dumps([logged.params, logged.tags])
        mlflow.artifacts.download_artifacts(artifact_uri=version.source, dst_path=str(folder / version.version),
                                            tracking_uri=client.tracking_uri)
    for path in folder.rglob("*"):
        if path.is_file():
            records[f"artifact {path.relative_to(folder)}"] = path.read_bytes().decode("latin-1")
    return records


def store_records(s3_store: str, outputs: Path) -> dict[str, str]:
    """Every stored object of the run's store prefix, and every file of its local outputs."""
    prefix = s3_store.removeprefix(f"s3://{BUCKET}/") + "/"
    s3 = boto3.session.Session().client("s3", region_name=REGION)  # boto3's default session keeps the old key
    records = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for item in page.get("Contents", []):
            records[item["Key"]] = s3.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read().decode("latin-1")
    records.update({str(p): p.read_bytes().decode("latin-1") for p in outputs.rglob("*") if p.is_file()})
    return records


@pytest.fixture
def ray_of_the_run():
    """The run starts its own Ray, whose workers inherit this test's planted credentials (the session's Ray
    holds the session's); shut down again afterwards, so that the next module starts the session's anew."""
    if ray.is_initialized():
        ray.shutdown()
    yield
    ray.shutdown()


@pytest.mark.slow  # a tiny distill through the CLI, and an MLflow server to start: ~1-2 minutes
def test_planted_secrets_appear_in_nothing_the_run_records(
        mlflow_server, prefect_server, s3_server, s3_store,  # noqa: F811 (mlflow_server: the imported fixture)
        tiny_teacher_dir, ray_of_the_run, tmp_path, monkeypatch, capfd):
    restore_after_test(monkeypatch, *MLFLOW_SETTINGS)
    monkeypatch.chdir(tmp_path)
    key_id, aws_secret = moto_credentials()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", aws_secret)
    token = f"tok-{uuid.uuid4().hex}"
    gate = BasicAuthGate(mlflow_server(), "dmd2", token)
    recipe = write_recipe(tmp_path / "tiny.toml", tiny_teacher_dir, rollouts=1)
    s3_server.require_credentials(True)  # from here on moto checks every request's signature
    try:
        code = cli(["distill", "--recipe", str(recipe), "--run-id", "secrets", "--store", s3_store,
                    "--tracking-uri", f"http://dmd2:{token}@127.0.0.1:{gate.port}",
                    "--output-dir", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")])
        assert code == 0
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "dmd2")  # the test's own look at what the run left
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", token)
        client = MlflowClient(f"http://127.0.0.1:{gate.port}")
        [run] = client.search_runs([client.get_experiment_by_name("dmd2").experiment_id])
        records = {**mlflow_records(client, run.info.run_id, "secrets", tmp_path / "downloaded"),
                   **asyncio.run(prefect_records()), **store_records(s3_store, tmp_path / "out")}
    finally:
        s3_server.require_credentials(False)
        gate.close()
    output = capfd.readouterr()
    records["stdout"], records["stderr"] = output.out, output.err

    secrets = {"the MLflow token": token, "its basic-auth header": base64.b64encode(f"dmd2:{token}".encode()).decode(),
               "AWS_SECRET_ACCESS_KEY": aws_secret, "the Ray token": default_token_file().read_text().strip()}
    leaks = [f"{secret} in {where}" for where, text in records.items() for secret, value in secrets.items()
             if value in text]
    assert not leaks
    # The credentials moved, they were not dropped: every request had them but the CLI's preflight probe of
    # /health, which needs none.
    assert set(gate.refused) <= {"/health"} and gate.passed > 0
    assert any(key.startswith("system/") for key in run.data.metrics)  # ... the ranks' requests too
    assert f"open http://***@127.0.0.1:{gate.port}" in output.out  # the CLI's hint, redacted
    assert f'"tracking_uri":"http://127.0.0.1:{gate.port}"' in records["flow runs"]  # the parameter, bare


def test_the_cli_refuses_credentials_it_cannot_move_before_prefect_starts(tmp_path, monkeypatch, capsys):
    restore_after_test(monkeypatch, *MLFLOW_SETTINGS)
    monkeypatch.chdir(tmp_path)
    secret = uuid.uuid4().hex
    database = socket.create_server(("127.0.0.1", 0))  # something answers where the database would be
    for option, uri in [("--tracking-uri", f"postgresql://dmd2:{secret}@127.0.0.1:{database.getsockname()[1]}/db"),
                        ("--store", f"s3://AKIAEXAMPLE:{secret}@bucket/runs"),
                        ("--store", f"file://dmd2:{secret}@host/data")]:
        try:
            code = cli(["distill", option, uri])
        except SystemExit as exit_info:
            code, message = 2, str(exit_info.code)
        else:
            message = capsys.readouterr().err
        assert code == 2 and secret not in message + capsys.readouterr().err
        assert ("PGPASSWORD" if option == "--tracking-uri" else "AWS_SECRET_ACCESS_KEY") in message
    database.close()
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "artifacts").exists()


@pytest.mark.parametrize("parameter", ["store_uri", "tracking_uri"])
def test_the_flow_refuses_a_parameter_carrying_credentials(parameter, prefect_server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    secret = uuid.uuid4().hex
    uri = {"store_uri": f"s3://AKIAEXAMPLE:{secret}@bucket/runs",
           "tracking_uri": f"https://dmd2:{secret}@mlflow.example.com"}[parameter]
    with pytest.raises(ConfigError, match=f"{parameter} .*://\\*\\*\\*@.* carries credentials.*environment") as info:
        distill(**{parameter: uri}, output_dir=str(tmp_path / "out"))
    assert secret not in str(info.value)
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "artifacts").exists()


# -- 2. only safetensors and JSON are loaded ------------------------------------------------------------


class TouchOnUnpickle:
    """Unpickling this creates `marker`: the proof that a pickle was run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def saved_unet(folder: Path) -> Path:
    torch.manual_seed(0)
    build_digits_unet(block_out_channels=(8, 16), norm_num_groups=4).save_pretrained(folder)
    return folder


def plant_pickle(folder: Path, marker: Path) -> None:
    (folder / "diffusion_pytorch_model.bin").write_bytes(pickle.dumps(TouchOnUnpickle(marker)))


def load_every_way(folder: Path):
    """The ways a student or critic directory is loaded: the ranks' and `dmd2 evaluate`'s (the family's
    load_model), `dmd2 sample`'s (load_pretrained), the logged MLflow model's (student_generator)."""
    family = DigitsFamily()
    return [family.load_model(str(folder)), load_pretrained(str(folder)),
            family.student_generator(folder, {"num_steps": 2, "shift": 1.0})]


def test_a_pickle_beside_the_safetensors_is_never_unpickled(tmp_path):
    folder, marker = saved_unet(tmp_path / "student"), tmp_path / "unpickled"
    expected = load_pretrained(str(folder)).state_dict()
    plant_pickle(folder, marker)
    model = load_every_way(folder)[0]
    assert not marker.exists()
    assert all(torch.equal(value, expected[name]) for name, value in model.state_dict().items())


def test_a_student_of_pickles_only_is_refused_from_the_store_and_the_cli(tmp_path, capsys):
    """A student with no safetensors, stored and fetched back as a run's export would be: a canary pickle and
    a loadable one (a plain state dict, which torch's weights-only unpickler would accept) are both refused."""
    folder, marker = saved_unet(tmp_path / "student"), tmp_path / "unpickled"
    weights = load_pretrained(str(folder)).state_dict()
    (folder / "diffusion_pytorch_model.safetensors").unlink()
    store = ArtifactStore(f"file://{tmp_path / 'store'}")
    for name, write in [("canary", lambda path: plant_pickle(path, marker)),
                        ("state dict", lambda path: torch.save(weights, path / "diffusion_pytorch_model.bin"))]:
        write(folder)
        fetched = store.get_dir(store.put_dir(f"run/student-{name.replace(' ', '-')}", folder), tmp_path / name)
        for load in (DigitsFamily().load_model, load_pretrained):
            with pytest.raises(OSError, match="pickled weights .*diffusion_pytorch_model.bin.* no safetensors"):
                load(str(fetched))
        assert cli(["evaluate", "--student", str(fetched)]) == 2  # refused as bad input, without a traceback
        assert "only safetensors are loaded" in capsys.readouterr().err
    assert not marker.exists()


def test_an_sd3_pipeline_with_pickled_weights_is_refused(tmp_path):
    """The transformer (the ranks' load, the generator's) or a text encoder (the generator's, the prompt
    encoding's) saved as a loadable pickle instead of safetensors: refused."""
    from dmd2.families.sd3.family import SD3Family
    from dmd2.families.sd3.generation import SD3Generator
    from tests.dmd2.families.sd3.tiny_pipeline import build_tiny_sd3_pipeline

    pipeline = build_tiny_sd3_pipeline(tmp_path / "pipeline")
    for part, weights, pickled in [
            ("transformer", "diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin"),
            ("text_encoder", "model.safetensors", "pytorch_model.bin")]:
        broken = Path(shutil.copytree(pipeline, tmp_path / f"pickled-{part}"))
        torch.save(load_file(broken / part / weights), broken / part / pickled)
        (broken / part / weights).unlink()
        with pytest.raises(OSError, match="safetensors"):
            SD3Generator.load(broken, num_steps=2, resolution=0, max_sequence_length=256)
        if part == "transformer":
            with pytest.raises(OSError, match="safetensors"):
                SD3Family().load_model(str(broken))


# -- 3. run ids cannot leave the store root ---------------------------------------------------------------


ESCAPES = ["..", "../x", "a/../../b", "/abs", "/etc/passwd", "C:\\x", "a\\..\\b", "%2e%2e", "%2e%2e%2fx", "bad\x00",
           "", "x" * 256, ".hidden", "s3://other/x", "file:///tmp/x"]


@pytest.fixture(params=["file", "s3"])
def store_root(request, tmp_path):
    """A store, and a listing of every file it could write outside its root too (the test's whole folder, or
    the whole bucket)."""
    if request.param == "file":
        return (ArtifactStore(f"file://{tmp_path / 'root'}"),
                lambda: sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()))
    request.getfixturevalue("s3_server")
    s3 = boto3.client("s3", region_name=REGION)
    return (ArtifactStore(f"s3://{BUCKET}/escapes-{uuid.uuid4().hex[:8]}/root"),
            lambda: sorted(item["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
                           for item in page.get("Contents", [])))


@pytest.mark.parametrize("run_id", ESCAPES)
def test_a_run_id_that_would_leave_the_store_root_is_refused(run_id, store_root, tmp_path):
    store, written = store_root
    source = tmp_path / "source"
    source.mkdir()
    (source / "weights.json").write_text("{}")
    before = written()
    with pytest.raises(ConfigError):
        check_run_id(run_id)
    attempts = [lambda: store.put_json(f"{run_id}/x.json", 1), lambda: store.put_dir(f"{run_id}/student", source),
                lambda: store.put_tensors(store.rollout_key(run_id, 0, "actor", 0), {"x": torch.ones(1)}),
                lambda: store.checkpoint_key(run_id, 1), lambda: store.latest_checkpoint(run_id),
                lambda: store.list_rollouts(run_id), lambda: store.prune(run_id, keep_last=0),
                lambda: store.find_json(f"{run_id}/x.json"), lambda: RunLease.check_free(store, run_id),
                lambda: RunLease.acquire(store, run_id, "test")]
    for attempt in attempts:
        with pytest.raises(ValueError):
            attempt()
    assert written() == before


def test_the_longest_run_id_stays_below_the_root(store_root):
    store, written = store_root
    run_id = check_run_id("r" * 255)
    store.get_json(store.put_json(f"{run_id}/x.json", 1))
    assert any(path.endswith(f"root/{run_id}/x.json") for path in written())


# -- 4. the local Ray wants its token -------------------------------------------------------------------


CLIENT = "import ray; ray.init(address={address!r}); print('CONNECTED', ray.get(ray.remote(lambda: 2).remote()))"


def ray_client(address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**env, "RAY_gcs_server_port_wait_time_s": "2"}  # a refused client gives up in ~2 s, not ~20
    return subprocess.run([sys.executable, "-c", CLIENT.format(address=address)], env=env, capture_output=True,
                          text=True, timeout=180, check=False)


def test_a_local_start_without_token_authentication_is_refused(monkeypatch):
    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match="RAY_AUTH_MODE=disabled: the local Ray this project starts keeps token"):
        ensure_ray(num_cpus=1)
    assert not ray.is_initialized()


def test_rays_default_token_file_is_made_private(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    prepare_token_auth()
    token = default_token_file()
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) == 64
    token.chmod(0o644)  # as Ray writes it under the usual umask
    prepare_token_auth()
    assert token.stat().st_mode & 0o777 == 0o600


def test_local_starts_at_once_all_read_the_one_whole_token(tmp_path, monkeypatch):
    """Two runs starting local Rays on one host at once: none may read a token file another has created
    but not yet written (Ray would start with an empty token)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    token_hex = cluster.secrets.token_hex  # drawing the token takes a while: a half-made file would be seen
    monkeypatch.setattr(cluster.secrets, "token_hex", lambda n: (time.sleep(0.02), token_hex(n))[1])

    def start() -> str:
        prepare_token_auth()
        return default_token_file().read_text()

    with ThreadPoolExecutor(8) as pool:
        tokens = list(pool.map(lambda _: start(), range(64)))
    assert len(set(tokens)) == 1 and len(tokens[0]) == 64
    assert [p.name for p in default_token_file().parent.iterdir()] == [default_token_file().name]  # no leftovers


def test_the_local_ray_refuses_clients_without_its_token(shared_ray, tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ensure_ray(num_cpus=1)
    address = ray.get_runtime_context().gcs_address
    assert ray.get(ray.remote(lambda: 1).remote()) == 1  # the project's own workers are let in
    outsider = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(tmp_path)}
    for label, env in [("no token", outsider),
                       ("a wrong token", outsider | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64})]:
        refused = ray_client(address, env)
        assert refused.returncode != 0 and "CONNECTED" not in refused.stdout, label
        assert "InvalidAuthToken" in refused.stderr or "Unauthenticated" in refused.stderr, label
    insider = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # RAY_AUTH_MODE=token, ~/.ray's token
    assert "CONNECTED 2" in ray_client(address, insider).stdout
