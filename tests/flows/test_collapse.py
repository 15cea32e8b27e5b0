"""The collapse guard in the distill flow: a digits run whose student's learning rate is multiplied by 1e3 after a
chosen rollout (the injected collapse) trips a rule, rolls back to a checkpoint from before the injection, goes on
and ends with a student whose digits-yardstick distances to the teacher (two judges: FD on the evaluator's features,
KID on the pixels) are within the healthy runs' noise (two seeds, in process, under the guard, which never trips
on them), where the unguarded collapsed run's are far off; MLflow and the Prefect artifact record the event. With `on_collapse = "stop"` the CLI exits non-zero naming the rule, and nothing
is exported or registered."""

import asyncio
import contextlib
import io

import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

import flows.distill
from dmd2.config import load_recipe
from dmd2.families.digits.evaluation import DigitsStudentEvaluator
from dmd2.families.digits.yardstick import DIGIT_CONDS
from dmd2.guard import RESEED_STRIDE
from dmd2.guarded_loop import GuardedRun
from dmd2.loop import InProcessDistiller
from dmd2.model import DiffusersVelocity, load_pretrained
from flows.cli import main
from flows.collapse import GUARD_RECORD
from flows.outputs import artifact_key
from infra.store import ArtifactStore
from tasks import runtime
from tests.tracking_db import tracking_uri_in

INJECT_AT = 8  # after this rollout's step the student trains at 1000 x its learning rate
PATIENCE = 3
ROLLOUTS, SAVE_INTERVAL = 16, 4
RECIPE = """
[model]
teacher = "{teacher}"
[student]
num_steps = 2
[optim]
lr = 1e-3
critic_lr = 2e-3
[dmd2]
critic_steps_per_rollout = 2
teacher_guidance_scale = 2.0
[train]
rollouts = {rollouts}
rollout_batch_size = 32
seed = 3
save_interval = {save_interval}
eval_interval = {eval_interval}
keep_rollouts = 1
[eval]
num_samples = 50
reference_steps = 4
[guard]
warmup = 6
window = 20
patience = {patience}
lr_scale = 0.5
on_collapse = "{on_collapse}"
{rules}"""
# The per-rollout rules switched off: only the evaluations' `eval_distance` can see the collapse.
EVALUATION_RULES_ONLY = "robust_k = 1e9\ngrad_ratio = 1e9\ndiversity_fraction = 1e-9\n"
EVAL_INTERVAL = 2


@pytest.fixture
def injected_collapse(monkeypatch):
    """The distill flow's rollouts, with the student's learning rate x 1e3 once rollout INJECT_AT has run."""
    rollout_flow, fired = flows.distill.rollout_flow, []

    def rollout_then_inject(run_id: str, rollout_id: int) -> dict[str, float]:
        metrics = rollout_flow(run_id, rollout_id)
        if rollout_id == INJECT_AT and not fired:
            fired.append(rollout_id)
            runtime.groups(run_id).actor.retune(seed=3, lr_factor=1e3)
        return metrics

    monkeypatch.setattr(flows.distill, "rollout_flow", rollout_then_inject)
    return fired


def _recipe(tmp_path, teacher, run_id: str, on_collapse: str, eval_interval: int = 0, rules: str = ""):
    recipe = tmp_path / f"{run_id}.toml"
    recipe.write_text(RECIPE.format(teacher=teacher, patience=PATIENCE, on_collapse=on_collapse, rollouts=ROLLOUTS,
                                     save_interval=SAVE_INTERVAL, eval_interval=eval_interval, rules=rules))
    return recipe


def _distill(tmp_path, teacher, run_id: str, on_collapse: str, cache, **recipe) -> tuple[int, str, str, str]:
    """The CLI's exit code and stderr, the store's and MLflow's URIs."""
    recipe = _recipe(tmp_path, teacher, run_id, on_collapse, **recipe)
    store, tracking = (tmp_path / "store").as_uri(), tracking_uri_in(tmp_path)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["distill", "--recipe", str(recipe), "--run-id", run_id, "--store", store, "--tracking-uri",
                     tracking, "--output-dir", str(tmp_path / "out"), "--cache-dir", str(cache)])
    return code, err.getvalue(), store, tracking


JUDGES = ("eval/fd_teacher", "eval/pixel_kid_teacher")  # the evaluator's features; the pixels (no trained model)


def _distances(evaluator: DigitsStudentEvaluator, model) -> dict[str, float]:
    """The digits yardstick's two distances of `model`'s samples to the teacher's (the run's own evaluation)."""
    scores = evaluator.evaluate(DiffusersVelocity(model.eval())).scores
    return {judge: scores[judge] for judge in JUDGES}


def _healthy(config, teacher_dir, seed: int):
    """The recipe's student trained in this process under the guard from `seed`: no rule may trip."""
    distiller = InProcessDistiller.from_models(config.replace("train", seed=seed), load_pretrained(str(teacher_dir)),
                                               DIGIT_CONDS, (1, 8, 8))
    guarded = GuardedRun(distiller)
    guarded.run()
    assert not guarded.events, guarded.events
    return distiller.student.model


def _collapsed(config, teacher_dir):
    """The recipe's student trained in this process with the injection and no guard."""
    distiller = InProcessDistiller.from_models(config, load_pretrained(str(teacher_dir)), DIGIT_CONDS, (1, 8, 8))
    distiller.run(range(INJECT_AT + 1))
    for group in distiller.student.optimizer.param_groups:
        group["lr"] *= 1e3
    distiller.student.scheduler.base_lrs = [lr * 1e3 for lr in distiller.student.scheduler.base_lrs]
    distiller.run(range(INJECT_AT + 1, config.train.rollouts))
    return distiller.student.model


async def _artifact(key: str):
    async with get_client() as client:
        found = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
        return found[-1].data if found else None


@pytest.mark.slow
def test_an_injected_collapse_trips_the_guard_which_rolls_back_before_it_and_the_run_ends_healthy(
        prefect_server, shared_ray, shared_cache, tiny_teacher_dir, tmp_path, injected_collapse):
    code, err, store_uri, tracking = _distill(tmp_path, tiny_teacher_dir, "collapsing", "rollback", shared_cache)
    assert code == 0, err
    store = ArtifactStore(store_uri)
    record = store.find_json(f"collapsing/{GUARD_RECORD}")
    [event] = record["events"]
    assert event["action"] == "rollback", event
    # the injected step's weights are first measured at rollout INJECT_AT + 1; the rule trips after its patience
    assert INJECT_AT + 1 <= event["onset"] and event["rollout"] <= INJECT_AT + PATIENCE + 1, event
    assert event["restored"] <= INJECT_AT and not record["suspects"][str(event["restored"])], event
    # every checkpoint there, those after the rollback taken again
    assert set(store.list_checkpoints("collapsing")) == set(range(SAVE_INTERVAL, ROLLOUTS + 1, SAVE_INTERVAL))
    assert not any(record["suspects"].values())  # the run ended with no suspect checkpoint
    client = MlflowClient(tracking)
    [run] = client.search_runs([client.get_experiment_by_name("dmd2").experiment_id])
    assert event["rule"] in run.data.tags["dmd2.guard"] and run.data.metrics["guard/rollbacks"] == 1
    assert f"- rule {event['rule']} tripped at rollout {event['rollout']}" in asyncio.run(
        _artifact(artifact_key("guard-collapsing")))

    # The recovered student against healthy runs from the recipe's seed and the rollback's, and the collapsed one.
    config = load_recipe(_recipe(tmp_path, tiny_teacher_dir, "collapsing", "rollback"))
    evaluator = DigitsStudentEvaluator.build(config, shared_cache)
    healthy = [_distances(evaluator, _healthy(config, tiny_teacher_dir, seed)) for seed in (3, 3 + RESEED_STRIDE)]
    collapsed = _distances(evaluator, _collapsed(config, tiny_teacher_dir))
    recovered = _distances(evaluator, load_pretrained(str(tmp_path / "out" / "collapsing" / "student")))
    # measured (16 rollouts), FD: healthy 79.1 and 57.7, collapsed 1222, recovered 67.3 (24 rollouts: 62.7, 64.2,
    # 1102, 64.6: the shorter runs' noise is wider, the collapse as far out); pixel KID: healthy 0.066 and 0.027,
    # collapsed 19.7, recovered 0.044
    for judge in JUDGES:  # both judges agree
        runs = [run[judge] for run in healthy]
        noise = abs(runs[0] - runs[1])
        assert abs(recovered[judge] - sum(runs) / 2) <= 3 * noise, (judge, recovered, healthy)
        assert collapsed[judge] > 3 * max(runs), (judge, collapsed, healthy)


@pytest.mark.slow
def test_with_on_collapse_stop_the_cli_exits_non_zero_naming_the_rule_and_exports_nothing(
        prefect_server, shared_ray, shared_cache, tiny_teacher_dir, tmp_path, injected_collapse):
    """Here the collapse is seen by an evaluation (the per-rollout rules are off): at the first one after the
    injection, the student's distance to the teacher is many times the run's best."""
    code, err, store_uri, tracking = _distill(tmp_path, tiny_teacher_dir, "stopping", "stop", shared_cache,
                                              eval_interval=EVAL_INTERVAL, rules=EVALUATION_RULES_ONLY)
    store = ArtifactStore(store_uri)
    [event] = store.find_json(f"stopping/{GUARD_RECORD}")["events"]
    assert event["action"] == "stop" and event["rule"] == "eval_distance", event
    # rollout INJECT_AT + 1 trains at the injected rate: the first evaluation after it sees the collapse
    assert event["onset"] == INJECT_AT + 2 + (-(INJECT_AT + 2)) % EVAL_INTERVAL == event["rollout"] + 1, event
    assert code != 0 and 'on_collapse = "stop"' in err, err
    assert (f"rule eval_distance tripped at the evaluation after rollout {event['rollout']} (the student of "
            f"{event['onset']} rollouts)") in err, err
    assert store.find_dir(f"stopping/student/{ROLLOUTS}") is None and not (tmp_path / "out" / "stopping").exists()
    assert not MlflowClient(tracking).search_registered_models()
