"""A critic that diverges stops the run at the step whose loss or gradient norm is not finite, with an error
naming the rollout, the group and the value; the step is not applied, the last good checkpoint stays the
latest, and no non-finite tensor is ever written to the store (nor any export)."""

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dmd2.failures import NonFiniteError
from flows.distill import distill
from infra.store import ArtifactStore
from infra.trainers.checkpoint import save_checkpoint
from infra.trainers.parallel import free_port
from tests.flows.conftest import write_recipe
from tests.reliability.faults import non_finite_tensors
from tests.tracking_db import tracking_uri_in

# lr = 10 warmed up over 8 steps: finite for a few rollouts, then the critic's loss is NaN
# (measured with the in-process loop: NaN at rollout 5 on the tiny teacher).
DIVERGING = ["optim.lr=10.0", "optim.critic_lr=10.0", "optim.warmup_steps=8"]


@pytest.mark.slow
def test_a_diverging_critic_stops_the_run_and_stores_nothing_non_finite(prefect_server, tiny_teacher_dir,
                                                                        shared_ray, shared_cache, tmp_path):
    recipe = write_recipe(tmp_path / "tiny.toml", tiny_teacher_dir, rollouts=10)
    store_root = tmp_path / "store"
    with pytest.raises(NonFiniteError) as failure:
        distill(recipe=str(recipe), run_id="diverges", overrides=DIVERGING, store_uri=store_root.as_uri(),
                tracking_uri=tracking_uri_in(tmp_path), cache_dir=str(shared_cache),
                output_dir=str(tmp_path / "out"))
    message = str(failure.value)
    # Either an optimizer step's loss or grad norm, or a stage's output (a model whose outputs overflowed).
    step = re.search(r"rollout (\d+), (critic|actor) group, optimizer step \d+ of \d+: loss = (\S+), "
                     r"grad norm = (\S+?)[:;]", message)
    output = re.search(r"rollout (\d+), the ([\w-]+) output of rank \d+ was not stored: .* not finite "
                       r"\(the first: (\S+)\)", message)
    assert step or output, message
    if step:
        values = [float(step[3].rstrip(",")), float(step[4])]
    else:
        values = [float(output[3])]
    assert not all(torch.isfinite(torch.tensor(values))), message
    rollout = int((step or output)[1])
    assert rollout >= 1, "the recipe should diverge after a first checkpoint"

    store = ArtifactStore(store_root.as_uri())
    assert store.latest_checkpoint("diverges").step == rollout  # the last good one, after `rollout` rollouts
    assert store.list_checkpoints("diverges") == list(range(1, rollout + 1))
    assert not (store_root / "diverges" / "student").exists() and not (tmp_path / "out" / "diverges").exists()
    assert non_finite_tensors(store_root) == []


def test_a_checkpoint_with_a_non_finite_weight_is_never_written(tmp_path):
    """The check at save, under the optimizer-step guard: weights made non-finite any other way are refused."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = nn.Linear(3, 2)
        optimizer = torch.optim.AdamW(model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        with torch.no_grad():
            model.weight[1, 2] = float("inf")
        store = ArtifactStore((tmp_path / "store").as_uri())
        with pytest.raises(NonFiniteError, match=r"weight: 1 of 6 values not finite"):
            save_checkpoint(store, "run/checkpoints/1", model, optimizer, scheduler, [], {}, None)
        assert store.latest_checkpoint("run") is None and not any((tmp_path / "store").rglob("*.distcp"))
    finally:
        dist.destroy_process_group()
