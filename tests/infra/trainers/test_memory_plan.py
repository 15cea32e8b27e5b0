"""`dmd2 plan`'s figures against a real run: the same rollout rehearsed on real tensors, measured by the CPU
allocator's own running total of allocated bytes (torch's profiler reports it with every allocation), a
different instrument from the plan's ledger; what sleeps is parked for real (`HostCopy`, the ranks' sleep) and
its host copies are taken off the total, as they would not be on a GPU. The plan's FLOPs, counted on fake tensors,
against the same counter over the real tensors' rehearsal."""

import collections
import gc
import json
import socket
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from dmd2.config import config_from_dict
from dmd2.families.digits.model import build_digits_unet
from dmd2.family import family_for
from infra.trainers.flops import CPU_ATTENTION_FLOPS, FlopCount
from infra.trainers.memory_plan import plan_memory
from infra.trainers.offload import HostCopy, own_storage
from infra.trainers.parallel import ddp, free_port, replicated
from infra.trainers.rehearsal import STAGES, Parking, gpu_models, rehearse, rehearse_outputs

TOLERANCE = 0.10


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> str:
    """The built-in digits teacher's architecture (not the tests' tiny one: its many small tensors would
    measure the allocator's rounding rather than the model)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("plan") / "teacher"
    build_digits_unet().save_pretrained(path)
    return str(path)


def config(teacher: str, parallel: str, critic_steps: int = 2, batch: int = 64, world_size: int = 1):
    return config_from_dict({
        "model": {"teacher": teacher}, "student": {"num_steps": 2},
        "optim": {"lr": 1e-4, "critic_lr": 2e-4},
        "dmd2": {"critic_steps_per_rollout": critic_steps, "teacher_guidance_scale": 2.0},
        "train": {"rollout_batch_size": batch, "world_size": world_size, "rollouts": 2,
                  "parallel": parallel},
    })


class HostCopies(Parking):
    """The ranks' own sleep: each name's tensors copied to host memory and their storages shrunk to nothing."""

    def __init__(self):
        self.copies: dict[str, HostCopy] = {}
        self.host_bytes: dict[str, int] = {}

    def park(self, name, tensors):
        self.copies[name] = HostCopy()
        self.host_bytes[name] = self.copies[name].offload(tensors)

    def unpark(self, name):
        self.copies.pop(name).restore()
        del self.host_bytes[name]


@contextmanager
def gloo_world_of_one():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def allocations(prof) -> list[tuple[int, int]]:
    """(time in ns, bytes allocated since the profile began) after every allocation and free, in time order: the
    running sum of the allocator's own records (what it allocated before the profile is not in it) of what the
    rank's own thread allocates (it makes the profile's first allocation: its models), kept by address.

    Other threads' blocks are gloo's own scratch buffers (its workers copy a collective's data through them),
    the CPU's stand-in for NCCL's buffers, which the plan leaves out as well; a rank's blocks they free (the
    last reference to a collective's input) still count as freed. An address handed out again was freed
    before, whatever time its free was stamped with: a free made in another thread is now and then stamped
    after the rank's thread has reused its block, and a plain running sum would then count the block twice."""
    found, events = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while events:
        event = events.pop()
        if event.tag == _EventType.Allocation:
            found.append((event.start_time_ns, event.extra_fields.alloc_size, event.extra_fields.ptr,
                          event.start_tid))
        events.extend(event.children)
    found.sort()
    rank_thread = next(tid for _, size, _, tid in found if size > 0)
    live, late_frees, total, totals = {}, collections.Counter(), 0, []  # live: address -> bytes counted
    for at, size, address, tid in found:
        if size > 0:
            if address in live:  # its free is stamped later: count it freed now, and skip that record
                late_frees[address] += 1
                total -= live.pop(address)
            live[address] = size if tid == rank_thread else 0
            total += live[address]
        elif late_frees[address]:
            late_frees[address] -= 1
        else:
            total -= live.pop(address, 0)
        totals.append((at, total))
    return totals


def measured(spec) -> tuple[dict[str, int], dict[str, int]]:
    """Each stage's peak bytes on real tensors: the allocator's total at its highest in the stage, less the host
    copies of what sleeps (constant through a stage: groups sleep and wake between stages); and its FLOPs."""
    family = spec.family.plan_bind(spec.config, "cpu")
    spec = type(spec)(spec.config, family, spec.sample_shape, spec.conds, spec.cache_dir)
    parking, windows, flops = HostCopies(), {}, {}

    @contextmanager
    def stage(name):
        gc.collect()  # garbage of the stages before (a reference cycle) outlives them by chance: no plan counts it
        start, counter = time.time_ns(), FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS)
        with counter:
            yield
        windows[name] = (start, time.time_ns(), sum(parking.host_bytes.values()))
        flops[name] = counter.get_total_flops()

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:  # before any model is made
        wrap = (lambda module: ddp(module, torch.device("cpu"))) if replicated(spec.config) else None  # DDP's own
        gpu = gpu_models(spec, lambda path, dtype: own_storage(family.load_model(path, dtype)), wrap=wrap)
        rehearse(gpu, stage, parking)
        rehearse_outputs(gpu, stage, parking)
    totals = allocations(prof)
    peaks = {}
    for name, (start, end, host) in windows.items():
        before = ([0] + [total for at, total in totals if at <= start])[-1]
        peaks[name] = max([before, *(total for at, total in totals if start < at <= end)]) - host
    return peaks, flops


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_each_stages_planned_peak_is_within_10_percent_of_the_measured_one(teacher, parallel):
    spec = family_for(config(teacher, parallel).model).plan_spec(config(teacher, parallel))
    plan = plan_memory(spec)
    with gloo_world_of_one() if parallel == "fsdp" else nullcontext():
        real, real_flops = measured(spec)
    assert [stage.stage for stage in plan.stages] == list(real) == [*STAGES, "evaluate", "checkpoint"]  # digits
    for stage in plan.stages:
        assert abs(stage.peak - real[stage.stage]) <= TOLERANCE * real[stage.stage], (stage, real)
    assert plan.flops == {name: real_flops[name] for name in STAGES}  # a rollout's; evaluations come now and then
    assert real_flops["critic-train"] > real_flops["actor-train"] > 0


def _measure_rank(rank: int, port: int, teacher: str, parallel: str, out: str) -> None:
    """One of two gloo ranks, in its own process: its stages' peaks, written to ``out``-<rank>.json."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        run = config(teacher, parallel, world_size=2)
        peaks, _ = measured(family_for(run.model).plan_spec(run))
        Path(f"{out}-{rank}.json").write_text(json.dumps(peaks))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_at_world_size_2_each_stages_planned_peak_is_within_10_percent_of_each_ranks(teacher, parallel, tmp_path):
    """The plan of one GPU of two (a fake process group) against two real gloo ranks, each in its own process. Under
    FSDP2 the teacher is sharded like the critic: half of it on each GPU while it scores."""
    run = config(teacher, parallel, world_size=2)
    plan = plan_memory(family_for(run.model).plan_spec(run))
    scoring = next(stage for stage in plan.stages if stage.stage == "score")
    shards = 2 if parallel == "fsdp" else 1
    assert scoring.by_category["teacher"] == pytest.approx(plan.whole["teacher"] / shards, rel=0.05)  # + padding
    out = str(tmp_path / "peaks")
    torch.multiprocessing.start_processes(_measure_rank, (free_port(), teacher, parallel, out), nprocs=2,
                                          start_method="spawn")
    for rank in range(2):
        real = json.loads(Path(f"{out}-{rank}.json").read_text())
        for stage in plan.stages:
            assert abs(stage.peak - real[stage.stage]) <= TOLERANCE * real[stage.stage], (rank, stage, real)


def test_the_planned_flops_count_every_critic_step_though_only_two_are_rehearsed(teacher):
    """Every critic step trains on 2 samples (the rollout's 2 per step): 6 steps compute three times what 2 do."""
    configs = [config(teacher, "ddp", steps, 2 * steps) for steps in (2, 6)]
    two, six = (plan_memory(family_for(each.model).plan_spec(each)) for each in configs)
    assert six.flops["critic-train"] == 3 * two.flops["critic-train"] > 0


def test_attention_on_the_cpu_counts_as_its_matrix_products():
    """Scores and output are two products of 2 L S E multiply-adds per head (4 B H L S E FLOPs); the backward
    recomputes the scores and takes four more products (10 B H L S E), as flash attention does on a GPU."""
    b, h, queries, keys, width = 2, 3, 40, 50, 16
    query = torch.randn(b, h, queries, width, requires_grad=True)
    key, value = (torch.randn(b, h, keys, width, requires_grad=True) for _ in range(2))
    with FlopCount() as forward:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value)
    with FlopCount() as backward:
        out.sum().backward()
    products = b * h * queries * keys * width
    assert (forward.total, backward.total) == (4 * products, 10 * products)
