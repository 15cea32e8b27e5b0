"""Per-GPU memory of the SD3.5 recipes' heaviest moments, measured at full model size on fake tensors.

    python -m bench.memory [--models medium,large] [--world-size 8] [--batch 4] [--resolution 1024]
                           [--layouts "fp32 ddp,bf16 fsdp ac"] [--json PATH]

No GPU and no weights: each MMDiT (its published config, dmd2/families/sd3/published.py) is built on the meta
device and given fake storage (`FakeTensorMode`); FSDP2 shards it over a fake process group of `--world-size`
ranks with the product's own `infra.trainers.parallel.fsdp`, and `dmd2.memory.MemoryLedger` counts every
storage alive on one rank. Figures are bytes of live tensors (no CUDA context, NCCL buffers or allocator
fragmentation: keep ~10% of a GPU for those). Measured per rank, for one layout at a time:

    train     two AdamW steps of a DMD2 group (critic-train, actor-train) on B samples, the second's peak:
              the trained model's weights, gradients and optimizer state, its activations and temporaries
    score     the frozen teacher (bf16; sharded like the critic under FSDP2, as the ranks hold it) on 2B samples
              (CFG's two branches) without grad, beside the critic's resident weights and optimizer state
    rollout   the student's forward without grad on B samples (one step of backward simulation)

"ddp" is measured as one whole replica, without DDP's gradient buckets (alive through the whole step, where
autograd's gradients come and go: `dmd2 plan` counts them at world size > 1). Both
groups are never awake at once (each sleeps after its stage), so a rank's peak is its largest row; the
sleeping group's state is parked in host memory, reported per node. Not measured: the stage code itself
(draws, losses, the GAN head), whose data-dependent steps fake tensors cannot run; the text encoders (they
encode the prompts once, before any group starts).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: make the repo importable

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from diffusers import SD3Transformer2DModel  # noqa: E402
from diffusers.utils import logging as diffusers_logging  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from dmd2.families.sd3.published import SD35_LARGE, SD35_MEDIUM, TEXT_TOKENS  # noqa: E402
from dmd2.memory import MemoryLedger  # noqa: E402
from infra.trainers.parallel import fsdp  # noqa: E402

GiB = 2**30
MODELS = {"medium": SD35_MEDIUM, "large": SD35_LARGE}


@dataclass(frozen=True)
class Layout:
    """How a group holds its model: precision, parallelism, activation checkpointing."""

    bf16: bool
    sharded: bool
    checkpointing: bool

    @classmethod
    def parse(cls, text: str) -> Layout:
        words = set(text.split())
        if not words <= {"fp32", "bf16", "ddp", "fsdp", "ac"} or len(words & {"fp32", "bf16"}) != 1 \
                or len(words & {"ddp", "fsdp"}) != 1:
            raise SystemExit(f"--layouts: {text!r} is not '<fp32|bf16> <ddp|fsdp> [ac]'")
        return cls("bf16" in words, "fsdp" in words, "ac" in words)

    def __str__(self) -> str:
        return " ".join(["bf16" if self.bf16 else "fp32", "fsdp" if self.sharded else "ddp",
                         *(["ac"] if self.checkpointing else [])])


def inputs(config: dict, batch: int, resolution: int) -> dict[str, torch.Tensor]:
    side = resolution // 8  # the VAE's 8x
    return dict(hidden_states=torch.randn(batch, config["in_channels"], side, side),
                encoder_hidden_states=torch.randn(batch, TEXT_TOKENS, config["joint_attention_dim"]),
                pooled_projections=torch.randn(batch, config["pooled_projection_dim"]),
                timestep=torch.rand(batch) * 1000)


def on_meta(config: dict, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The MMDiT in ``dtype`` with no storage (made outside the fake mode, whose tensors cannot be swapped)."""
    with torch.device("meta"):
        return SD3Transformer2DModel.from_config(config).to(dtype)


def model(built: torch.nn.Module, layout: Layout, mesh) -> torch.nn.Module:
    """``built`` given fake storage on the CPU, standing in for the GPU, and held as ``layout`` says."""
    built.to_empty(device="cpu")
    if layout.checkpointing:
        built.enable_gradient_checkpointing()
    return fsdp(built, layout.bf16, mesh) if layout.sharded else built


def measure(config: dict, layout: Layout, world_size: int, batch: int, resolution: int) -> dict:
    """The rows of one model and layout, in bytes per rank."""
    mesh = init_device_mesh("cpu", (world_size,)) if layout.sharded else None  # outside the fake mode
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=layout.bf16)
    rows, ledger = {}, MemoryLedger()
    trained, teacher = on_meta(config), on_meta(config, torch.bfloat16 if layout.bf16 else torch.float32)
    with FakeTensorMode(allow_non_fake_inputs=True):
        # Built before the ledger starts (a module's tensors cannot be swapped while a mode watches them);
        # each is counted from when it is labelled.
        trained = model(trained, layout, mesh)
        teacher = model(teacher, Layout(layout.bf16, layout.sharded, False), mesh).eval().requires_grad_(False)
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-5, betas=(0.0, 0.999))
        with ledger:
            ledger.label(trained, "weights")
            for step in range(2):  # the first makes AdamW's moments; the second is every later step
                with ledger.stage(f"train {step}"):
                    with autocast:
                        out = trained(**inputs(config, batch, resolution)).sample
                    out.float().pow(2).mean().backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            rows["train"] = ledger.peaks[-1]
            with torch.no_grad():
                with ledger.stage("rollout"), autocast:
                    trained(**inputs(config, batch, resolution))
                rows["rollout"] = ledger.peaks[-1]
                ledger.label(teacher, "teacher")  # on the device only while scoring
                with ledger.stage("score"), autocast:
                    teacher(**inputs(config, 2 * batch, resolution))
                rows["score"] = ledger.peaks[-1]
        parameters = sum(p.numel() for p in teacher.parameters())
    state = rows["train"].by_category["weights"] + rows["train"].by_category["optimizer"]
    return {"parameters": parameters,
            "rows": {name: {"peak": peak.peak, **peak.by_category} for name, peak in rows.items()},
            "peak": max(peak.peak for peak in rows.values()),
            # Per rank, parked on the host while asleep: two groups' state, and the teacher between scorings.
            "host_parked_per_rank": 2 * state + rows["score"].by_category["teacher"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="medium,large", help="SD3.5 teachers: medium, large (comma-separated)")
    parser.add_argument("--world-size", type=int, default=8, help="ranks per group (GPUs of a node)")
    parser.add_argument("--batch", type=int, default=4, help="B: samples per rank per optimizer step")
    parser.add_argument("--resolution", type=int, default=1024, help="image side in pixels")
    parser.add_argument("--layouts", default="fp32 ddp,bf16 fsdp ac",
                        help="comma-separated '<fp32|bf16> <ddp|fsdp> [ac]' (ac: activation checkpointing)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    layouts = [Layout.parse(text) for text in args.layouts.split(",")]
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        raise SystemExit(f"--models: unknown {sorted(unknown)}; choose from {sorted(MODELS)}")
    diffusers_logging.set_verbosity_error()  # a bf16 cast on the meta device warns once per model
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    print(f"command: python -m bench.memory {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"per rank of {args.world_size}, B = {args.batch}, {args.resolution} px; GiB of live tensors")
    print(f"{'model':7} {'layout':14} {'stage':8} {'peak':>6} {'weights':>8} {'grads':>6} {'optim':>6} "
          f"{'teacher':>8} {'activ':>6} {'temp':>6}")
    results = {}
    for name in args.models.split(","):
        for layout in layouts:
            began = time.perf_counter()
            figures = measure(MODELS[name], layout, args.world_size, args.batch, args.resolution)
            results[f"{name} {layout}"] = figures | {"seconds": time.perf_counter() - began}
            for stage, row in figures["rows"].items():
                print(f"{name:7} {str(layout):14} {stage:8} {row['peak'] / GiB:6.1f} {row['weights'] / GiB:8.1f} "
                      f"{row['gradients'] / GiB:6.1f} {row['optimizer'] / GiB:6.1f} {row['teacher'] / GiB:8.1f} "
                      f"{row['activations'] / GiB:6.1f} {row['temporaries'] / GiB:6.1f}")
            print(f"{name:7} {str(layout):14} {'=> peak':8} {figures['peak'] / GiB:6.1f}   "
                  f"({figures['parameters'] / 1e9:.2f} B parameters; parked on the host per node: "
                  f"{figures['host_parked_per_rank'] * args.world_size / GiB:.0f} GiB; measured in "
                  f"{results[f'{name} {layout}']['seconds']:.0f} s)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
