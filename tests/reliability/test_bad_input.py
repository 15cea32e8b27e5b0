"""Bad input is refused in seconds (issue 13): the real CLI, run as a subprocess in an empty working folder,
exits 2 with a message naming the option (or file) and the fix, having imported none of the heavy
libraries (torch, Prefect, Ray, MLflow, diffusers, ...) and created nothing: no store folder, no MLflow
database, no outputs. What was imported is read from `sys.modules` at exit, not timed."""

import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from flows import preflight as checks
from flows.recipe import DEFAULT_RECIPE, RECIPES, STORE_NAME, check_run_id

HEAVY = {"torch", "prefect", "ray", "mlflow", "diffusers", "transformers", "s3fs", "boto3", "botocore", "fsspec"}
SETTINGS = ("RAY_ADDRESS", "PREFECT_API_URL", "MLFLOW_TRACKING_URI", "DMD2_STORE", "HF_HUB_OFFLINE", "HF_HUB_CACHE")
SD3_RECIPE = RECIPES / "sd35-medium-4step.toml"
# Runs a Python snippet (the CLI, or a call of the preflight) and writes the top-level modules it had
# imported by its exit, however it exited, to the file named by its first argument.
WRAPPER = """
import atexit, json, sys
record = sys.argv.pop(1)
atexit.register(lambda: open(record, "w").write(json.dumps(sorted({m.split(".")[0] for m in sys.modules}))))
exec(sys.argv.pop(1))
"""
CLI = "from flows.cli import main\nsys.argv[0] = 'dmd2'\nsys.exit(main())"


def run_light(tmp_path: Path, code: str, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `code` with `argv` in the empty folder tmp_path/cwd; assert it imported nothing heavy and
    created nothing there."""
    cwd, record = tmp_path / "cwd", tmp_path / "modules.json"
    cwd.mkdir(exist_ok=True)
    clean = {key: value for key, value in os.environ.items() if key not in SETTINGS}
    result = subprocess.run([sys.executable, "-c", WRAPPER, str(record), code, *argv], cwd=cwd,
                            env=clean | (env or {}), capture_output=True, text=True, timeout=120, check=False)
    imported = set(json.loads(record.read_text()))
    assert not imported & HEAVY, f"imported {sorted(imported & HEAVY)}: {result.stderr}"
    assert list(cwd.iterdir()) == []  # no ./artifacts, no mlflow.db, no ./outputs
    return result


def refusal(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> str:
    """The CLI's refusal of `argv`: exit 2, nothing heavy imported, nothing created; returns its message."""
    result = run_light(tmp_path, CLI, *argv, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    return result.stderr


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (it was free a moment ago)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_json(root: Path, files: dict[str, dict]) -> Path:
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(json.dumps(content))
    return root


def sd3_pipeline(root: Path, scheduler: str = "FlowMatchEulerDiscreteScheduler") -> Path:
    """The JSON files of an SD3 pipeline directory (all its checks read; no weights)."""
    return write_json(root, {
        "model_index.json": {"_class_name": "StableDiffusion3Pipeline"},
        "scheduler/scheduler_config.json": {"_class_name": scheduler, "shift": 3.0},
        "vae/config.json": {"latent_channels": 16, "block_out_channels": [128, 256, 512, 512]},
        "transformer/config.json": {"in_channels": 16, "patch_size": 2, "sample_size": 128},
    })


def digits_unet(root: Path) -> Path:
    return write_json(root, {"config.json": {"_class_name": "UNet2DModel", "num_class_embeds": 11,
                                             "in_channels": 1, "sample_size": 8}})


def sd3_args(teacher: Path | str, prompts: Path | str) -> list[str]:
    return ["distill", "--recipe", str(SD3_RECIPE), "--set", f"model.teacher={teacher}", "--set",
            f"data.prompts={prompts}"]


def test_a_malformed_recipe_names_the_file_and_line(tmp_path):
    recipe = tmp_path / "broken.toml"
    recipe.write_text('[model]\nteacher = "builtin:digits"\n[train\nrollouts = 2\n')
    message = refusal(tmp_path, "distill", "--recipe", str(recipe))
    assert re.search(rf"{re.escape(str(recipe))} is not valid TOML: .*at line 3.*fix that line", message)


def test_a_recipe_that_is_not_text_names_the_file(tmp_path):
    recipe = tmp_path / "binary.toml"
    recipe.write_bytes(b'[model]\nteacher = "\xff\xfe"\n')
    assert f"recipe {recipe} cannot be read as UTF-8 text" in refusal(tmp_path, "run", "--recipe", str(recipe))


@pytest.mark.parametrize("argv, message", [
    (["distill", "--set", "train.rolouts=5"], r"\[train\] has no option 'rolouts'; it takes .*rollouts"),
    (["distill", "--set", "rollouts"], r"--set 'rollouts': write SECTION\.KEY=VALUE, e\.g\."),
    (["distill", "--set", "train.rollouts=many"], r"\[train\] rollouts: expected int, got 'many'"),
    (["distill", "--set", "dmd2.critic_steps_per_rollout=3"],
     r"\[dmd2\] critic_steps_per_rollout \(3\) must divide each rank's shard of 160 samples .*change either"),
    (["distill", "--set", "train.loss_type=flow_matching"], r"\[dmd2\] options are read only with .*remove"),
    (["distill", "--set", "data.prompts=p.txt"], r"\[data\] prompts: read only by text-to-image .*remove them"),
    (["distill", "--set", "data.images=real"], r"\[data\] images: read only by text-to-image .*remove them"),
    (["distill", "--rollouts", "0"], "--rollouts must be >= 1"),
    (["distill", "--run-id", "../evil"], r"invalid --run-id '\.\./evil': use 1-255 characters"),
    (["distill", "--run-id", "_shared"], "--run-id '_shared' starts with '_'.*choose another id"),
    (["distill", "--set", "model.family=video"], r"\[model\] family = 'video' is not a model family; choose"),
    (["serve", "--name", "nightly", "--set", "optim.lr=-1"], r"\[optim\] lr must be > 0"),
    (["evaluate", "--student", "no/such/student"], "--student no/such/student is not a directory; give"),
    (["distill", "--set", "cluster.cpus_per_rank=1000"],  # what a local Ray could never place: not a 120 s wait
     r"world_size = 1 with \[cluster\] cpus_per_rank = 1000 needs 1 bundles of 2000 CPUs .* a local Ray on this "
     r"machine has \d+ CPUs \(it holds 0\): lower either, or unset \[cluster\] cpus_per_rank"),
])
def test_bad_options_and_combinations_are_refused(tmp_path, argv, message):
    assert re.search(message, refusal(tmp_path, *argv))


def test_an_unknown_option_in_the_recipe_is_named(tmp_path):
    recipe = tmp_path / "typo.toml"
    recipe.write_text('[model]\nteacher = "builtin:digits"\n[dmd2]\n[train]\nrolouts = 5\n')
    message = refusal(tmp_path, "distill", "--recipe", str(recipe))
    assert f"{recipe}: unknown option(s) [train] rolouts; [train] takes loss_type, rollouts" in message


def test_a_missing_teacher_is_refused(tmp_path):
    missing = tmp_path / "no" / "teacher"
    message = refusal(tmp_path, "distill", "--set", "model.family=digits", "--set", f"model.teacher={missing}")
    assert f"[model] teacher = '{missing}' does not exist; give a model directory" in message
    message = refusal(tmp_path, "distill", "--set", f"model.teacher={missing}")  # no family to ask
    assert "no model family recognises [model] teacher" in message and "(no such file or directory)" in message


def test_a_model_of_the_wrong_kind_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    pipeline, unet = sd3_pipeline(tmp_path / "sd3"), digits_unet(tmp_path / "unet")
    for option, spec in (("teacher", tmp_path / "empty"), ("teacher", pipeline), ("critic_load", pipeline)):
        message = refusal(tmp_path, "distill", "--set", "model.family=digits", "--set", f"model.{option}={spec}")
        assert f"[model] {option} = '{spec}' is not a class-conditional digits UNet2DModel directory" in message
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    message = refusal(tmp_path, *sd3_args(unet, prompts))
    assert f"[model] teacher = '{unet}' is neither a model nor a pipeline directory" in message
    message = refusal(tmp_path, *sd3_args(pipeline, prompts), "--set", f"model.student={unet}")
    assert f"[model] student = '{unet}' is not an SD3 pipeline directory; give" in message
    message = refusal(tmp_path, *sd3_args(sd3_pipeline(tmp_path / "ddpm", "DDPMScheduler"), prompts))
    assert "is 'DDPMScheduler'; DMD2 on SD3 needs a flow-matching teacher" in message
    message = refusal(tmp_path, *sd3_args(pipeline, prompts), "--set", f"eval.clip_model={unet}")
    assert f"[eval] clip_model = '{unet}' is not a transformers CLIPModel directory" in message


def test_a_missing_prompts_file_is_refused(tmp_path):
    missing = tmp_path / "missing.txt"
    message = refusal(tmp_path, *sd3_args(sd3_pipeline(tmp_path / "sd3"), missing))
    assert f"[data] prompts {missing}: does not exist; give a text file" in message


def test_an_offline_hub_id_must_be_in_the_cache(tmp_path):
    cache = tmp_path / "hub"
    cache.mkdir()
    offline = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    message = refusal(tmp_path, *sd3_args("stabilityai/stable-diffusion-3.5-medium", prompts), env=offline)
    assert "'stabilityai/stable-diffusion-3.5-medium' is a hub id that is not in the local Hugging Face cache" \
        in message and "download it first" in message
    # cached, the snapshot is checked like a local directory
    snapshot = cache / "models--org--ddpm" / "snapshots" / "abc123"
    sd3_pipeline(snapshot, "DDPMScheduler")
    (cache / "models--org--ddpm" / "refs").mkdir()
    (cache / "models--org--ddpm" / "refs" / "main").write_text("abc123")
    assert "is 'DDPMScheduler'" in refusal(tmp_path, *sd3_args("org/ddpm", prompts), env=offline)


def test_bad_store_uris_are_refused(tmp_path):
    (tmp_path / "a-file").write_text("")
    message = refusal(tmp_path, "distill", "--store", "gs://bucket/dmd2")
    assert "--store 'gs://bucket/dmd2': unsupported store scheme 'gs'; use file:///<folder>" in message
    message = refusal(tmp_path, "distill", "--store", f"file://{tmp_path}/a-file/store")
    assert f"--store {tmp_path}/a-file/store cannot be created: {tmp_path}/a-file is a file" in message
    message = refusal(tmp_path, "distill", env={"DMD2_STORE": "s3://Not_A_Bucket/dmd2"})
    assert "DMD2_STORE: 'Not_A_Bucket' is not an S3 bucket name" in message
    message = refusal(tmp_path, "distill", "--store", "s3://key:secret@bucket/dmd2")
    assert "must not embed credentials" in message and "secret" not in message
    assert not (tmp_path / "a-file").read_text()


def test_outputs_that_overlap_the_store_or_cannot_be_made_are_refused(tmp_path):
    (tmp_path / "a-file").write_text("")
    message = refusal(tmp_path, "distill", "--output-dir", "artifacts/out")
    assert "--output-dir artifacts/out and --store file://" in message and "give them separate folders" in message
    message = refusal(tmp_path, "distill", "--output-dir", str(tmp_path / "a-file" / "out"))
    assert f"--output-dir {tmp_path}/a-file/out cannot be created" in message


def test_servers_that_do_not_answer_are_refused(tmp_path):
    port = closed_port()
    message = refusal(tmp_path, "distill", env={"RAY_ADDRESS": f"127.0.0.1:{port}"})
    assert f"RAY_ADDRESS '127.0.0.1:{port}': nothing answers at 127.0.0.1:{port}" in message
    assert "ray start --head" in message
    message = refusal(tmp_path, "run", "--ray-address", "http://head:8265")
    assert "--ray-address 'http://head:8265': unsupported scheme 'http'; give auto, host:port" in message
    message = refusal(tmp_path, "distill", env={"PREFECT_API_URL": f"http://127.0.0.1:{port}/api"})
    assert f"PREFECT_API_URL: nothing answers at http://127.0.0.1:{port}/api/health" in message
    assert "prefect server start" in message
    message = refusal(tmp_path, "distill", "--tracking-uri", f"http://user:token@127.0.0.1:{port}")
    assert f"--tracking-uri 'http://127.0.0.1:{port}': nothing answers at http://127.0.0.1:{port}/health" in message
    assert "start the MLflow server" in message and "token" not in message


def test_bad_tracking_uris_are_refused(tmp_path):
    missing = tmp_path / "no" / "folder"
    message = refusal(tmp_path, "distill", env={"MLFLOW_TRACKING_URI": f"sqlite:///{missing}/mlflow.db"})
    assert f"MLFLOW_TRACKING_URI 'sqlite:///{missing}/mlflow.db': the folder {missing} of the database does not " \
           f"exist; create it (mkdir -p {missing})" in message
    assert not missing.exists()
    message = refusal(tmp_path, "distill", "--tracking-uri", "gopher://mlflow")
    assert "--tracking-uri 'gopher://mlflow': unsupported tracking URI scheme 'gopher'; use sqlite:///" in message


@pytest.mark.parametrize("argv", [["--help"], ["distill", "--help"], ["serve", "--help"], ["table", "--help"]])
def test_help_is_light(tmp_path, argv):
    result = run_light(tmp_path, CLI, *argv)
    assert result.returncode == 0 and "usage: dmd2" in result.stdout


def test_the_default_recipe_passes_the_preflight(tmp_path):
    code = ("from flows.preflight import preflight\n"
            "checked = preflight(sys.argv[1], run_id='digits-4step')\n"
            "print(checked.family, checked.run_id, checked.config.train.rollouts, checked.tracking_uri)")
    result = run_light(tmp_path, code, str(DEFAULT_RECIPE))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["digits", "digits-4step", "250", "sqlite:///mlflow.db"]


def test_a_local_sd3_run_passes_the_preflight(tmp_path, monkeypatch):
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a cat"}\n')
    overrides = [f"model.teacher={sd3_pipeline(tmp_path / 'sd3')}", f"data.prompts={prompts}"]
    checked = checks.preflight(SD3_RECIPE, overrides, run_id="sd3", store_uri="s3://bucket/dmd2/runs")
    assert (checked.family, checked.store_uri) == ("sd3", "s3://bucket/dmd2/runs")


class Health(http.server.BaseHTTPRequestHandler):
    """A server whose /health and /api/health answer 200 (MLflow's, Prefect's), every other path 404."""

    def do_GET(self):
        self.send_response(200 if self.path in ("/health", "/api/health") else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server():
    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_servers_that_answer_pass(health_server):
    checks.check_tracking_uri(health_server)
    checks.check_prefect_api(health_server + "/api")
    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]
        checks.check_ray_address(f"127.0.0.1:{port}")
        checks.check_ray_address(f"ray://127.0.0.1:{port}")
    checks.check_ray_address("auto")


def test_a_server_without_health_is_refused(health_server):
    with pytest.raises(checks.ConfigError, match=r"/mlflow/health answered HTTP 404; start the MLflow server"):
        checks.check_tracking_uri(health_server + "/mlflow")


def test_the_repeated_rules_agree_with_the_store_and_tracking():
    """The preflight repeats a few rules of modules it cannot import lightly; they must agree."""
    from infra.store import validate_name
    from infra.store.s3 import validate_bucket
    from infra.tracking import DEFAULT_TRACKING_URI

    def accepts(rule, value) -> bool:
        try:
            rule(value)
            return True
        except ValueError:
            return False

    names = ["run", "digits-4step", "a.b_c-9", "_x", "x" * 255, "x" * 256, "", ".hidden", "-opt", "a/b", "..",
             "s3://x", "a b", "é"]
    assert [bool(STORE_NAME.fullmatch(n)) for n in names] == [accepts(validate_name, n) for n in names]
    assert [accepts(check_run_id, n) for n in names] == [accepts(validate_name, n) and n[0] != "_" for n in names]
    buckets = ["my-bucket", "a.b.c", "ab", "a" * 63, "a" * 64, "Bucket", "-bucket", "bucket-", "bu_cket"]
    assert [bool(checks.S3_BUCKET.fullmatch(b)) for b in buckets] == [accepts(validate_bucket, b) for b in buckets]
    assert checks.DEFAULT_TRACKING_URI == DEFAULT_TRACKING_URI


def test_the_families_package_faces_still_resolve():
    from dmd2.families import digits, sd3

    for package in (digits, sd3):
        assert sorted(dir(package)) == sorted(package.__all__)
        assert all(getattr(package, name) is not None for name in package.__all__)


def test_prefect_logs_an_explained_error_without_its_traceback_and_any_other_with_it():
    """The CLI prints a ConfigError's or RunError's message last; Prefect's log of it keeps one line, not a
    traceback above it. Any other exception keeps its traceback."""
    import io
    import logging

    from dmd2.config import ConfigError
    from dmd2.failures import RunError
    from flows.cli import NoTracebackForExplainedErrors

    logger, out = logging.Logger("flow_runs"), io.StringIO()
    logger.addHandler(logging.StreamHandler(out))
    logger.addFilter(NoTracebackForExplainedErrors())
    for error in (ConfigError("[train] rollouts = 0: give >= 1"), RunError("the critic diverged"), KeyError("x")):
        try:
            raise error
        except Exception as exc:
            logger.exception("Encountered exception during execution: %r", exc)
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["Encountered exception during execution: ConfigError('[train] rollouts = 0: give >= 1')",
                         "Encountered exception during execution: RunError('the critic diverged')"]
    assert lines[2:4] == ["Encountered exception during execution: KeyError('x')", "Traceback (most recent call last):"]
