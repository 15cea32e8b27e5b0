"""Loading in the training dtype (dmd2/model.py `load_pretrained`): the host's private memory while a
model loads stays near the model's bytes in that dtype; loading sharded (infra/trainers/models.py
`sharded_from_rank0`), a rank other than 0 holds little more than its shards.

The measurement is bench/loading.py's (each load in a process of its own; what it counts and why is in its
docstring). diffusers' eager path is measured beside it and printed as the baseline, not asserted.
"""

import math

import pytest
from safetensors import safe_open

from bench.loading import MiB, measure, measure_sharded, save_bench_model

# The fixed cost of a load, whatever the model's size: 12 MiB measured with a 0.3 MiB model, nearly all of
# it a process's first `from_pretrained` making its modules and caches (a second load adds 0.6 MiB; the
# sampler thread adds nothing measurable). 32 MiB leaves room for the allocator and stays below the 1.2x
# margin itself (34 MiB on this model in bf16).
SLACK = 32 * MiB


def weight_count(path) -> int:
    """The number of weights in a saved model, from its safetensors header (no tensor is read)."""
    with safe_open(path / "diffusion_pytorch_model.safetensors", "pt") as weights:
        return sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory):
    return save_bench_model(tmp_path_factory.mktemp("loading") / "unet")


@pytest.mark.slow  # ~25 s of CPU, mostly importing torch and diffusers in the measuring process
def test_peak_host_memory_while_loading_stays_near_the_models_bytes(bench_model):
    path = bench_model
    count = weight_count(path)
    bf16, eager_bf16, fp32 = measure(path, [("bf16", False), ("bf16", True), ("fp32", False)])
    for load in (bf16, eager_bf16, fp32):
        print(load.line())
    assert (bf16.model, fp32.model) == (2 * count, 4 * count)  # loaded in the dtype asked for
    assert bf16.peak <= 1.2 * 2 * count + SLACK
    assert fp32.peak <= 1.2 * 4 * count + SLACK


@pytest.mark.slow  # two processes importing torch and diffusers
def test_loading_sharded_a_rank_other_than_0_holds_little_more_than_its_shards(bench_model):
    """Two gloo ranks load the 342 MiB model sharded in fp32: rank 0 reads it whole into its host memory and
    each rank receives its shards, so rank 1 peaks at 1.2 x its shards + `SLACK` (every rank loading the whole
    model, as before, peaks at the whole model: `python bench/loading.py` prints both), and rank 0 at 1.2 x
    (the whole model + its shards) + `SLACK`."""
    rank0, rank1 = sorted(measure_sharded(bench_model, 2), key=lambda load: load.rank)
    for load in (rank0, rank1):
        print(load.line())
    whole = 4 * weight_count(bench_model)
    assert rank0.model == rank1.model == whole and rank0.shard + rank1.shard == whole
    assert rank1.peak <= 1.2 * rank1.shard + SLACK
    assert rank0.peak <= 1.2 * (whole + rank0.shard) + SLACK
