"""The digits distillation as flows, end to end: Prefect (in-process server), local Ray, the store on
moto's S3 server, MLflow on sqlite; checked through the real APIs."""

import asyncio
import time

import pytest
import torch
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
from prefect.events.filters import EventFilter, EventNameFilter

from dmd2.config import load_recipe
from dmd2.families.digits.yardstick import DIGIT_CONDS
from dmd2.loop import InProcessDistiller
from dmd2.model import load_pretrained as load_model
from infra.store import ArtifactStore
from tests.flows.conftest import TINY_EVAL_INTERVAL, TINY_ROLLOUTS

ROLLOUTS = TINY_ROLLOUTS
TASKS = ["rollout", "sleep", "convert", "critic-train", "score", "sleep", "actor-train", "sleep"]


@pytest.fixture(scope="module")
def finished_run(tiny_run):
    return tiny_run


async def _flow_runs():
    async with get_client() as client:
        [parent] = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name={"any_": ["distill-tiny"]}))
        children = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent.id])))
        tasks = {run.name: await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [run.id]}))
                 for run in children}
        return parent, children, tasks


def _eventually(check, what: str, timeout_s: float = 30.0):
    """`check()`'s first truthy result: the server records task states and events in batches."""
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.5)
    return found


def test_each_rollout_is_a_flow_run_with_its_tasks_under_the_distill_run(finished_run):
    def all_recorded():
        parent, children, tasks = asyncio.run(_flow_runs())
        done = all(run.state.is_completed() for runs in tasks.values() for run in runs)
        return (parent, children, tasks) if done and len(tasks) == ROLLOUTS else None

    parent, children, tasks = _eventually(all_recorded, "every task run of every rollout recorded as completed")
    assert parent.state.is_completed()
    assert sorted(run.name for run in children) == [f"rollout-{i}" for i in range(ROLLOUTS)]
    for name, runs in tasks.items():
        ordered = sorted(runs, key=lambda run: run.expected_start_time)
        assert [run.name.rsplit("-", 1)[0] for run in ordered] == TASKS, name


async def _heartbeat_sources() -> set[str]:
    async with get_client() as client:
        page = await client.read_events(EventFilter(event=EventNameFilter(name=["prefect.flow-run.heartbeat"])),
                                        limit=50)  # the API allows 50; newest first
        return {event.resource.id for event in page.events}


def test_the_distill_run_heartbeats_and_its_rollout_runs_do_not(finished_run):
    """Crash detection rests on the distill flow run's heartbeat: the rollout flow runs run in its process
    and send none of their own (stopping one cost up to a second per rollout)."""
    parent, children, _ = asyncio.run(_flow_runs())
    def parent_heartbeat_seen():
        found = asyncio.run(_heartbeat_sources())
        return found if f"prefect.flow-run.{parent.id}" in found else None

    sources = _eventually(parent_heartbeat_seen, "the distill run's heartbeat")
    assert not sources & {f"prefect.flow-run.{child.id}" for child in children}


def test_mlflow_has_every_metric_once_per_step_images_and_the_student(finished_run):
    result, _, uri = finished_run
    client = MlflowClient(uri)
    run = client.get_run(result["mlflow_run_id"])
    for key in ["train/loss", "train/grad_norm", "train/lr", "train/critic-loss", "train/critic-grad_norm",
                "train/critic-lr", "train/dmd_grad_abs", "train/dmd_normaliser", "train/x0_recompute_max_diff",
                "time/rollout", "time/critic-train", "time/actor-train"]:
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert sorted(steps) == list(range(ROLLOUTS)), key
    evaluated = [done - 1 for done in range(1, ROLLOUTS + 1) if done % TINY_EVAL_INTERVAL == 0 or done == ROLLOUTS]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval/fd_teacher")) == evaluated
    assert run.data.params["dmd2.critic_steps_per_rollout"] == "2"
    assert run.data.tags["dmd2.store"].startswith("s3://") and "prefect.flow_run_id" in run.data.tags
    assert run.data.tags["dmd2.student_weights"] == "raw"  # no [student] ema_decay: evaluated and exported raw
    images = [a.path for a in client.list_artifacts(run.info.run_id, "images") if a.path.endswith(".png")]
    assert len(images) == len(evaluated)  # a sample grid per evaluation
    assert any(a.path == "student/config.json" for a in client.list_artifacts(run.info.run_id, "student"))


def test_refs_are_in_the_store_and_the_student_loads_with_from_pretrained(finished_run, s3_store):
    result, _, _ = finished_run
    store = ArtifactStore(s3_store)
    assert store.list_rollouts("tiny") == list(range(ROLLOUTS))[-2:]  # the recipe keeps 2
    assert store.list_checkpoints("tiny") == list(range(1, ROLLOUTS + 1))
    student = load_model(result["student_dir"])
    assert student.config.num_class_embeds == 11


def test_the_flows_train_the_same_student_as_the_in_process_loop(finished_run, tiny_teacher_dir):
    result, recipe, _ = finished_run
    config = load_recipe(recipe)
    distiller = InProcessDistiller.from_models(config, load_model(str(tiny_teacher_dir)), DIGIT_CONDS, (1, 8, 8))
    distiller.run(range(ROLLOUTS))
    flow_student = load_model(result["student_dir"]).state_dict()
    for name, expected in distiller.student.model.state_dict().items():
        assert torch.allclose(flow_student[name], expected, atol=1e-5, rtol=0), name


def test_the_distill_flow_run_has_a_lineage_artifact_and_the_student_a_registered_version(finished_run):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    result, _, uri = finished_run

    async def read():
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["distill-tiny"])))

    [artifact] = asyncio.run(read())
    assert result["model_version"] == "tiny/1" and "champion" in result["promotion"]
    for expected in (result["mlflow_run_id"], "tiny/1", result["student"]["uri"], f"| DMD2 student ({ROLLOUTS} rollouts) |"):
        assert expected in artifact.data, expected
    champion = MlflowClient(uri).get_model_version_by_alias("tiny", "champion")
    assert int(champion.version) == 1 and champion.tags["dmd2.mlflow_run_id"] == result["mlflow_run_id"]
