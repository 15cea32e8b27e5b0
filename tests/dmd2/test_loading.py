"""Loading in the training dtype (dmd2/model.py `load_pretrained`): the host's private memory while a
model loads stays near the model's bytes in that dtype.

The measurement is bench/loading.py's (each load in a process of its own; what it counts and why is in its
docstring). diffusers' eager path is measured beside it and printed as the baseline, not asserted.
"""

import math

import pytest
from safetensors import safe_open

from bench.loading import MiB, measure, save_bench_model

# The fixed cost of a load, whatever the model's size: 12 MiB measured with a 0.3 MiB model, nearly all of
# it a process's first `from_pretrained` making its modules and caches (a second load adds 0.6 MiB; the
# sampler thread adds nothing measurable). 32 MiB leaves room for the allocator and stays below the 1.2x
# margin itself (34 MiB on this model in bf16).
SLACK = 32 * MiB


def weight_count(path) -> int:
    """The number of weights in a saved model, from its safetensors header (no tensor is read)."""
    with safe_open(path / "diffusion_pytorch_model.safetensors", "pt") as weights:
        return sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())


@pytest.mark.slow  # ~25 s of CPU, mostly importing torch and diffusers in the measuring process
def test_peak_host_memory_while_loading_stays_near_the_models_bytes(tmp_path):
    path = save_bench_model(tmp_path / "unet")
    count = weight_count(path)
    bf16, eager_bf16, fp32 = measure(path, [("bf16", False), ("bf16", True), ("fp32", False)])
    for load in (bf16, eager_bf16, fp32):
        print(load.line())
    assert (bf16.model, fp32.model) == (2 * count, 4 * count)  # loaded in the dtype asked for
    assert bf16.peak <= 1.2 * 2 * count + SLACK
    assert fp32.peak <= 1.2 * 4 * count + SLACK
