"""The device check: a DMD2 rollout's stages in one process on one device, through the product's own code, timed
stage by stage and set beside `dmd2 plan`'s prediction for the same run.

    python bench/gpu.py [--tiny] [--variants sleep no-sleep compile no-checkpointing] [--rollouts 2]
                        [--parallel fsdp|ddp] [--peak-tflops T] [--json PATH] [--workdir DIR]

The stages are `infra.trainers.rehearsal.rehearse`'s: what a GPU's two ranks run in a rollout (the student's
rollout, convert, the critic's steps, the teacher's and the critic's scoring, the actor's step), each group
asleep while the other works, with `dmd2/`'s training and the family's model calls, at world size 1. Only torch,
diffusers and transformers are needed: Ray, Prefect, MLflow, boto3 and the store are never imported, so it runs
on a bare GPU image with one carried wheel (bench/gpu_check.sh).

Shape: on CUDA a full-size SD3.5 Medium MMDiT (random weights, saved in bf16) at 1024 px (16 x 128 x 128
latents) as teacher, student and critic, with text encoders and a VAE as small as its input widths allow
(tests/dmd2/families/sd3/tiny_pipeline.py); the recipe is recipes/sd35-medium-4step.toml at world size 1.
`--tiny` (the default without CUDA): the tests' tiny pipeline.

Variants, each with its models built afresh: `sleep` (the recipe: a group parked in host memory while the other
works), `no-sleep` (nothing parked: `[train] sleep = "never"`), `compile` (`[train] compile = true`: each block
compiled), `no-checkpointing` (`[train] activation_checkpointing = false`). Each runs one untimed rollout (first
allocations, kernel choice, compilation), then `--rollouts` timed ones, every critic step of them.

Per stage: compute seconds (CUDA events around it; on CPU the host clock), wall seconds (host clock, the device
synchronised at both ends), FLOPs (the plan's count at the same shape, torch's formulas), MFU against the stated
peak (`--peak-tflops`, default the device's dense bf16 datasheet figure) and against a bf16 matrix product
measured in this run, and the peak allocated bytes (`torch.cuda.max_memory_allocated`; n/a on CPU) beside the
plan's. "between stages" is the rollout's wall time outside its stages: sleep and wake copies. The JSON is
rewritten after every stage, so a run cut short keeps every figure it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import tempfile
import time
import tomllib
from contextlib import contextmanager
from pathlib import Path

# Run as a file, Python puts bench/ (not the repository) on sys.path.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.gpu_table import table  # noqa: E402
from dmd2.config import DistillConfig, config_from_dict  # noqa: E402
from dmd2.families.sd3.published import SD35_MEDIUM, TEXT_TOKENS  # noqa: E402
from dmd2.family import family_for  # noqa: E402
from infra.trainers.memory_plan import plan_memory  # noqa: E402
from infra.trainers.rehearsal import Parking, gpu_models, rehearse  # noqa: E402
from infra.trainers.offload import HostCopy, own_storage  # noqa: E402
from infra.trainers.parallel import free_port, use_device  # noqa: E402

RECIPE = ROOT / "recipes" / "sd35-medium-4step.toml"
PROMPTS = ["a photo of a cat", "a red dog", "a blue sign", "the cat on the sign", "a dog on the sign",
           "a red cat", "the blue dog", "a photo of the sign"]
# Dense bf16 peaks by device name, the first key found in it wins (vendors' datasheets); none for any other
# device, nor for the H200 NVL, whose clocks and peak differ from the SXM part's.
PEAK_BF16 = {"H200 NVL": None, "H200": 989e12, "H100 80GB HBM3": 989e12, "H100 SXM": 989e12, "A100": 312e12}
# [train] settings the plan does not depend on (the plan is of one rollout as it runs with sleep; compiling changes
# no tensor it holds), at the values its cache key takes
NOT_IN_THE_PLAN = {"sleep": "always", "compile": False}
# name -> ([train] settings over the recipe's, whether groups sleep)
# compile turns checkpointing off: the two do not combine yet (dmd2/config_rules.py)
VARIANTS = {"sleep": ({}, True), "no-sleep": ({"sleep": "never"}, False),
            "compile": ({"compile": True, "activation_checkpointing": False}, True),
            "no-checkpointing": ({"activation_checkpointing": False}, True)}


@dataclasses.dataclass(frozen=True)
class Shape:
    """A pipeline to build: the MMDiT's config, the VAE's scale factor (pixels per latent), the CLIP tokenizers'
    length (SD3: 77), T5's layers, the dtype the MMDiT's weights are saved in."""

    transformer: dict
    vae_scale_factor: int = 8
    clip_max_length: int = 77
    t5_layers: int = 1
    saved_dtype: torch.dtype | None = torch.bfloat16  # random weights: bf16 halves the bytes written and read


def shapes() -> dict[str, Shape]:
    from tests.dmd2.families.sd3.tiny_pipeline import TINY_TRANSFORMER

    return {"sd35-medium": Shape(SD35_MEDIUM),
            "tiny": Shape(TINY_TRANSFORMER, vae_scale_factor=2, clip_max_length=32, t5_layers=2, saved_dtype=None)}


def build_teacher(shape: Shape, folder: Path) -> Path:
    """The shape's StableDiffusion3Pipeline in ``folder`` (built once: a folder holding one is reused)."""
    from tests.dmd2.families.sd3.tiny_pipeline import build_sd3_pipeline

    if not (folder / "model_index.json").is_file():
        build_sd3_pipeline(folder, shape.transformer, vae_scale_factor=shape.vae_scale_factor,
                           clip_max_length=shape.clip_max_length, t5_layers=shape.t5_layers,
                           transformer_dtype=shape.saved_dtype)
    return folder


def recipe(teacher: Path, prompts: Path, args: argparse.Namespace, train: dict) -> DistillConfig:
    """The shipped SD3.5 Medium recipe at world size 1, with a variant's ``train`` settings."""
    data = tomllib.loads(RECIPE.read_text())
    data["model"]["teacher"], data["data"]["prompts"] = str(teacher), str(prompts)
    data["data"].pop("resolution", None)  # the pipeline's own: its sample size times the VAE's scale factor
    data["dmd2"]["critic_steps_per_rollout"] = args.critic_steps
    data["train"].update(world_size=1, rollouts=1 + args.rollouts, rollout_batch_size=args.critic_steps * args.batch,
                         mixed_precision=args.precision, **({"parallel": args.parallel} if args.parallel else {}),
                         **train)
    return config_from_dict(data, source=f"{RECIPE.name} (bench/gpu.py)")


def matmul_flops(device: torch.device) -> float:
    """FLOP/s of a square bf16 matrix product on ``device`` (the mean of ten after three warm-ups): what this
    device's matrix units give here, the measured side of the MFU."""
    n = 8192 if device.type == "cuda" else 512
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    synchronize(device)
    return 10 * 2 * n**3 / (time.perf_counter() - start)


def attention_op(device: torch.device, transformer: dict, sample_shape: tuple[int, ...], dtype: torch.dtype) -> str:
    """The operator `F.scaled_dot_product_attention` runs for the MMDiT's joint attention here (flash, memory-efficient,
    cuDNN, or the math fallback): torch picks it by device, dtype and shape, below the Python dispatch key that
    sees it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    patch = transformer["patch_size"]
    tokens = (sample_shape[-2] // patch) * (sample_shape[-1] // patch) + TEXT_TOKENS
    q = torch.zeros(1, transformer["num_attention_heads"], tokens, transformer["attention_head_dim"], device=device,
                    dtype=dtype)
    with Seen():
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    return next((name for name in seen if "attention" in name), " ".join(seen))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Resident(Parking):
    """Nothing sleeps: every group and the teacher stay on the device (`[train] sleep = "never"`)."""

    def park(self, name, tensors):
        pass

    def unpark(self, name):
        pass


class HostCopies(Parking):
    """The ranks' own sleep: each name's tensors copied to (pinned) host memory, their device storage freed."""

    def __init__(self):
        self.copies: dict[str, HostCopy] = {}

    def park(self, name, tensors):
        self.copies[name] = HostCopy()
        self.copies[name].offload(tensors)

    def unpark(self, name):
        self.copies.pop(name).restore()


class StageClock:
    """Each stage's compute and wall seconds and peak allocated bytes, one rollout at a time; ``on_stage`` hears
    each stage as soon as it is measured."""

    def __init__(self, device: torch.device, on_stage):
        self.device, self.on_stage, self.stages = device, on_stage, {}

    @contextmanager
    def stage(self, name: str):
        cuda = self.device.type == "cuda"
        synchronize(self.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        yield
        if cuda:
            end.record()
        synchronize(self.device)
        wall = time.perf_counter() - began
        self.stages[name] = {"compute_s": start.elapsed_time(end) / 1e3 if cuda else wall, "wall_s": wall,
                             "peak_bytes": torch.cuda.max_memory_allocated(self.device) if cuda else None}
        self.on_stage(name, self.stages[name])


@contextmanager
def world_of_one(device: torch.device):
    """A one-process group (NCCL on CUDA, gloo on CPU): FSDP2 shards over it as the ranks do over theirs."""
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1, device_id=device if device.type == "cuda" else None)
    try:
        yield
    finally:
        dist.destroy_process_group()


def measure_variant(config: DistillConfig, prepared: dict, sleep: bool, device: torch.device, args, report) -> None:
    """One untimed rollout, then ``args.rollouts`` timed ones of ``config`` on ``device``; ``report(key, value)``
    hears every figure as soon as it is measured."""
    family = family_for(config.model)
    bound = family.bind(prepared, device)
    spec = dataclasses.replace(family.run_spec(config, args.cache), family=bound)

    def load(path: str, dtype: torch.dtype | None):
        return own_storage(bound.load_model(path, dtype).to(device))

    use_device(device)  # as a rank does: TF32 for fp32 matmuls
    with world_of_one(device):
        gpu = gpu_models(spec, load, device=device)
        parking = HostCopies() if sleep else Resident()
        rehearse(gpu, StageClock(device, lambda name, figures: None).stage, parking, every_step=True)  # warm-up
        for rollout in range(args.rollouts):
            clock = StageClock(device, lambda name, figures, r=rollout: report(("rollouts", r, name), figures))
            began = time.perf_counter()
            rehearse(gpu, clock.stage, parking, every_step=True)
            synchronize(device)
            report(("rollouts", rollout, "rollout_wall_s"), time.perf_counter() - began)


def run(args: argparse.Namespace, write) -> dict:
    """Every variant of ``args``; ``write(result)`` after each figure."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    stated = args.peak_tflops * 1e12 if args.peak_tflops else next(
        (peak for key, peak in PEAK_BF16.items() if key in name), None) if device.type == "cuda" else None
    result = {"command": " ".join(["python bench/gpu.py", *args.argv]), "device": name, "torch": torch.__version__,
              "shape": args.shape, "peak_flops_stated": stated, "matmul_flops": matmul_flops(device), "variants": {}}
    write(result)
    folder = args.workdir / f"teacher-{args.shape}"
    progress(f"building the {args.shape} pipeline in {folder} (once per --workdir)")
    teacher = build_teacher(shapes()[args.shape], folder)
    prompts = args.workdir / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    shared = {"plans": {}}  # what variants share: the prompts' encoding, plans by the settings they depend on
    for variant in args.variants:
        figures = result["variants"][variant] = {}
        try:
            config = recipe(teacher, prompts, args, VARIANTS[variant][0])
            family = family_for(config.model)
            family.check(config)
            config = family.resolve(config, args.cache)
            if "attention" not in result:
                shape = family.run_spec(config, args.cache).sample_shape
                dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
                result["attention"] = attention_op(device, shapes()[args.shape].transformer, shape, dtype)
            figures["plan"] = planned(config, shared["plans"], variant)
            write(result)
            if "prepared" not in shared:
                progress("encoding the prompts (once)")
                shared["prepared"] = family.prepare(config)
            measure_variant(config, shared["prepared"], VARIANTS[variant][1], device, args,
                            reporter(result, variant, write))
        except Exception as error:  # one variant failing (out of memory, say) leaves the others' figures
            figures["error"] = f"{type(error).__name__}: {error}"
            progress(f"{variant} failed: {figures['error']}")
            write(result)
        gc.collect()  # after the except block: until it ends, a failure's traceback holds the variant's tensors
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def planned(config: DistillConfig, plans: dict, variant: str) -> dict:
    """`dmd2 plan`'s figures for ``config`` (one plan per set of the settings it depends on), or {"error": ...}:
    a plan that fails leaves the measurement to go on."""
    memory = config.replace("train", **{name: value for name, value in NOT_IN_THE_PLAN.items()
                                        if hasattr(config.train, name)})
    if repr(memory) not in plans:
        progress(f"{variant}: planning (dmd2 plan on fake tensors)")
        try:
            plans[repr(memory)] = plan_memory(family_for(memory.model).plan_spec(memory)).to_dict()
        except Exception as error:
            plans[repr(memory)] = {"error": f"{type(error).__name__}: {error}"}
            progress(f"{variant}: the plan failed: {plans[repr(memory)]['error']}")
    return plans[repr(memory)]


def reporter(result: dict, variant: str, write):
    """``report(key, value)`` for `measure_variant`: the figure into the variant's part of ``result``, written."""
    def report(key: tuple, value) -> None:
        at = result["variants"][variant]
        for part in key[:-1]:
            at = at.setdefault(str(part), {})
        at[key[-1]] = value
        write(result)
        if isinstance(value, dict):
            progress(f"{variant}, rollout {key[1]}, {key[2]}: {value['compute_s']:.3f} s compute")
    return report


def progress(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/gpu.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny pipeline (the default without CUDA)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), metavar="VARIANT",
                        help=f"which to run, of {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--rollouts", type=int, default=2, help="timed rollouts per variant (default 2)")
    parser.add_argument("--critic-steps", type=int, default=2, help="K, critic steps per rollout (default 2)")
    parser.add_argument("--batch", type=int, default=2, help="B, samples per critic step (default 2)")
    parser.add_argument("--precision", choices=("bf16", "no"), default="bf16", help="[train] mixed_precision")
    parser.add_argument("--parallel", choices=("fsdp", "ddp"), help="[train] parallel (default: the recipe's)")
    parser.add_argument("--peak-tflops", type=float, help="the device's peak for the MFU (default: its datasheet "
                        "dense bf16 figure where known, e.g. 989 for an H200)")
    parser.add_argument("--workdir", type=Path, help="keeps the built pipeline for the next run (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="write the figures here (after every stage)")
    args = parser.parse_args(argv)
    if args.rollouts < 1:
        parser.error("--rollouts must be >= 1")
    args.shape = "tiny" if args.tiny or not torch.cuda.is_available() else "sd35-medium"
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the check, print its table and return the figures (also written to --json)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)

    def write(result: dict) -> None:
        if args.json:
            temp = args.json.with_name(f".{args.json.name}.tmp")
            temp.write_text(json.dumps(result, indent=1) + "\n")
            temp.replace(args.json)  # whole or not there: a cut run leaves the last complete one

    with tempfile.TemporaryDirectory() as tmp:
        args.cache = Path(tmp) / "cache"
        args.workdir = args.workdir or Path(tmp)
        args.workdir.mkdir(parents=True, exist_ok=True)
        result = run(args, write)
    print(table(result), flush=True)
    return result


if __name__ == "__main__":
    main()
