"""DMD2 on SD3.5 Medium at scale: seconds per stage, samples/s, accelerator memory with and without
sleep, and MFU, through the product's own path (a pipeline directory, the recipe, the prepared prompt
table, Ray trainer groups, the stage functions of `infra.trainers.stages`).

    python -m bench.gpu [--shape sd35-medium|small|tiny] [--tiny] [--parallel ddp [fsdp]] [--world-size 1]
                        [--critic-steps 2] [--batch 2] [--rollouts 2] [--json PATH] [--workdir DIR]

On a GPU the default shape is a full-size SD3.5 Medium MMDiT (random weights, saved in bf16) at 1024 px
(16 x 128 x 128 latents) as teacher, student and critic; its text encoders and VAE are as small as
the MMDiT's input widths allow (tests/dmd2/families/sd3/tiny_pipeline.py). Without CUDA the default is
the tests' tiny pipeline, and the memory rows read n/a (CPU ranks report no accelerator memory).

Each timed rollout calls the stages one by one in `run_rollout_on_groups`'s order, waking each group
explicitly (wake and sleep timed apart from the work); peaks are `TrainerGroup.peak_device_memory(reset=True)`
of both groups around every step. The stages run one
after another and the idle group allocates nothing, so the device's peak during a step is the active
group's peak plus the idle group's resident memory (whatever it holds then: asleep, or awake between
its stages). "Without sleep" runs the same stages with no group ever put to sleep, after one untimed
rollout that leaves both awake (tests/infra/trainers/test_group.py's rollout_without_sleep).
Memory figures are bytes the ranks' tensors occupy (torch.cuda.max_memory_allocated; no CUDA contexts, NCCL
buffers or allocator caches); "device used" is cudaMemGetInfo (all processes) sampled every 5 ms here.

FLOPs. F = FLOPs of one student forward per sample and F_fb of a forward and backward, counted by
torch.utils.flop_counter.FlopCounterMode over the MMDiT on the meta device at the batch shape (the
teacher, student and critic share the architecture). With W ranks, K critic steps of B samples per
rank, M = W K B samples, one rollout costs:
    rollout      sum over the M samples of (i + 1) F     sample stopped at step i runs i + 1 student calls
                                                        (i drawn from the plan's "stop" stream: ~(N+1)/2)
    critic-train K W B F_fb                              (+ W B F for critic_scoring = "original")
    score        g W B F                                 g = 2 with CFG (both branches in one batch), else 1
    actor-train  A W B F_fb                              A = actor steps per rollout (1)
The fake score is free (fused scoring keeps x0_fake from the critic's last training forward). Not counted:
FSDP's idle lockstep calls, activation recompute, math outside the model. MFU = FLOPs / W / (s per rollout) / peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

# Run as a file, Python puts bench/ (not the repository) on sys.path.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402
import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from dmd2.config import DistillConfig, config_from_dict  # noqa: E402
from dmd2.families.sd3.published import SD35_MEDIUM  # noqa: E402
from dmd2.family import family_for  # noqa: E402
from dmd2.model import DiffusersVelocity  # noqa: E402
from dmd2.plan import rollout_plan  # noqa: E402
from infra.store import ArtifactStore  # noqa: E402
from infra.trainers import (Groups, build_groups, ensure_ray, load_prepared, prepare_inputs,  # noqa: E402
                            run_rollout_on_groups)
from infra.trainers.stages import (actor_train_stage, convert_stage, critic_train_stage, rollout_stage,  # noqa: E402
                                   score_stage, sleep_stage)
from bench.gpu_table import table  # noqa: E402
from tests.dmd2.families.sd3.tiny_pipeline import TINY_TRANSFORMER, build_sd3_pipeline  # noqa: E402

RECIPE = ROOT / "recipes" / "sd35-medium-4step.toml"
PROMPTS = ["a photo of a cat", "a red dog", "a blue sign", "the cat on the sign", "a dog on the sign",
           "a red cat", "the blue dog", "a photo of the sign"]
# Dense bf16 peaks by device name, the first key found in it wins (vendors' datasheets); MFU is n/a on any
# other device, and on the H200 NVL, whose clocks and peak differ from the SXM part's.
PEAK_BF16 = {"H200 NVL": None, "H200": 989e12, "H100 80GB HBM3": 989e12, "H100 SXM": 989e12, "A100": 312e12}


@dataclass(frozen=True)
class Shape:
    """A pipeline to build: the MMDiT's config (over the tiny one), the VAE's scale factor (pixels per
    latent), the CLIP tokenizers' length (SD3: 77), T5's layers, the dtype the MMDiT's weights are saved in."""

    transformer: dict
    vae_scale_factor: int = 8
    clip_max_length: int = 77
    t5_layers: int = 1
    saved_dtype: torch.dtype | None = torch.bfloat16  # random weights: bf16 halves the bytes written and read


SMALL = dict(sample_size=32, num_layers=8, num_attention_heads=12, caption_projection_dim=768,
             dual_attention_layers=(0, 1, 2, 3))
SHAPES = {
    "sd35-medium": Shape(SD35_MEDIUM),  # 1024 px
    # SD3.5 Medium's widths, 8 layers of 768, 256 px: the models' memory dwarfs the rest, and it runs quickly.
    "small": Shape(SD35_MEDIUM | SMALL),
    "tiny": Shape(TINY_TRANSFORMER, vae_scale_factor=2, clip_max_length=32, t5_layers=2, saved_dtype=None),
}


def build_teacher(shape: Shape, folder: Path) -> Path:
    """The shape's StableDiffusion3Pipeline in ``folder`` (built once: a folder holding one is reused)."""
    if not (folder / "model_index.json").is_file():
        build_sd3_pipeline(folder, shape.transformer, vae_scale_factor=shape.vae_scale_factor,
                           clip_max_length=shape.clip_max_length, t5_layers=shape.t5_layers,
                           transformer_dtype=shape.saved_dtype)
    return folder


def recipe(teacher: Path, prompts: Path, args: argparse.Namespace, parallel: str) -> DistillConfig:
    """The shipped SD3.5 Medium recipe at this benchmark's size."""
    data = tomllib.loads(RECIPE.read_text())
    data["model"]["teacher"], data["data"]["prompts"] = str(teacher), str(prompts)
    data["data"].pop("resolution")  # the pipeline's own: its sample size times the VAE's scale factor
    data["student"]["num_steps"] = args.student_steps
    data["dmd2"]["critic_steps_per_rollout"] = args.critic_steps
    data["train"].update(world_size=args.world_size, rollouts=2 * args.rollouts + 2, parallel=parallel,
                         rollout_batch_size=args.critic_steps * args.batch * args.world_size,
                         mixed_precision=args.precision)
    return config_from_dict(data, source=f"{RECIPE.name} (bench/gpu.py)")


# -- FLOPs -----------------------------------------------------------------------------------------

def count_flops(teacher: Path, sample_shape: tuple[int, ...], text: tuple[int, int], pooled: int,
                batch: int) -> tuple[float, float, int]:
    """(F, F_fb, parameters): per-sample FLOPs of one forward and of one forward + backward of the
    teacher's MMDiT at batch ``batch``, counted on the meta device (shapes only: nothing is computed)."""
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        config = SD3Transformer2DModel.load_config(str(teacher), subfolder="transformer")
        model = SD3Transformer2DModel.from_config(config)
        x_s, sigma = torch.zeros(batch, *sample_shape), torch.zeros(batch)
        cond = {"encoder_hidden_states": torch.zeros(batch, *text), "pooled_projections": torch.zeros(batch, pooled)}
    velocity, counts = DiffusersVelocity(model), []
    for backward in (False, True):
        counter = FlopCounterMode(display=False)
        with counter:
            v = velocity(x_s, sigma, cond)
            if backward:
                v.float().square().mean().backward()
        counts.append(counter.get_total_flops() / batch)
    return counts[0], counts[1], sum(p.numel() for p in model.parameters())


def rollout_flops(config: DistillConfig, sample_shape: tuple[int, ...], rollout_id: int, forward: float,
                  forward_backward: float) -> dict[str, float]:
    """The model FLOPs of one rollout over all ranks, by stage (the module docstring's count)."""
    plan = rollout_plan(config, rollout_id, sample_shape)
    every_sample = torch.arange(plan.world_size * plan.critic_steps * plan.batch)
    student_calls = int((plan.draws.integers("stop", plan.num_steps, every_sample) + 1).sum())
    scored = plan.world_size * plan.batch
    dmd2 = config.dmd2
    return {"rollout": student_calls * forward,
            "critic-train": plan.critic_steps * scored * forward_backward
            + (scored * forward if dmd2.critic_scoring == "original" else 0.0),
            "score": (1 if dmd2.teacher_guidance_scale == 1 else 2) * scored * forward,
            "actor-train": dmd2.actor_steps_per_rollout * scored * forward_backward}


def peak_flops(device_name: str) -> float | None:
    return next((peak for key, peak in PEAK_BF16.items() if key in device_name), None)


# -- one rollout, step by step ----------------------------------------------------------------------

class DeviceUse:
    """Device-wide memory in use (all processes; the most loaded device), sampled every 5 ms; `take`
    returns the peak since the last `take`."""

    def __init__(self) -> None:
        self.enabled = torch.cuda.is_available()
        self._peak, self._stop = 0, threading.Event()
        if self.enabled:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            infos = [torch.cuda.mem_get_info(device) for device in range(torch.cuda.device_count())]
            self._peak = max(self._peak, *(total - free for free, total in infos))

    def take(self) -> int | None:
        peak, self._peak = self._peak, 0
        return peak if self.enabled else None

    def close(self) -> None:
        self._stop.set()


@dataclass(frozen=True)
class Step:
    """One step of a rollout: its wall time, and each group's per-rank peak of allocated bytes during it."""

    name: str
    seconds: float
    peak: dict[str, list[int]]
    device_used: int | None


def timed(groups: Groups, use: DeviceUse, steps: list[Step], name: str, call):
    """``call()``, timed and its memory peaks taken, as a Step appended to ``steps``; returns its result."""
    for group in groups.in_order():
        group.peak_device_memory(reset=True)
    use.take()
    start = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - start
    peaks = {group.role: group.peak_device_memory(reset=True) for group in groups.in_order()}
    steps.append(Step(name, seconds, peaks, use.take()))
    return result


def instrumented_rollout(groups: Groups, run: str, rollout_id: int, sleep: bool, use: DeviceUse) -> list[Step]:
    """`run_rollout_on_groups`'s stages in its order, each group woken explicitly before its first stage;
    ``sleep`` False leaves out the sleeps."""
    steps: list[Step] = []
    timed(groups, use, steps, "wake actor", groups.actor.wake)
    samples = timed(groups, use, steps, "rollout", lambda: rollout_stage(groups, run, rollout_id))
    if sleep:  # the critic's stages come next
        timed(groups, use, steps, "sleep actor after rollout", lambda: sleep_stage(groups.actor))
    pairs = timed(groups, use, steps, "convert", lambda: convert_stage(groups, run, rollout_id, samples))
    timed(groups, use, steps, "wake critic", groups.critic.wake)
    kept, _ = timed(groups, use, steps, "critic-train", lambda: critic_train_stage(groups, run, rollout_id, pairs))
    scores = timed(groups, use, steps, "score", lambda: score_stage(groups, run, rollout_id, kept, pairs))
    if sleep:
        timed(groups, use, steps, "sleep critic", lambda: sleep_stage(groups.critic))
    timed(groups, use, steps, "wake actor for its step", groups.actor.wake)
    timed(groups, use, steps, "actor-train", lambda: actor_train_stage(groups, run, rollout_id, pairs, scores))
    if sleep:
        timed(groups, use, steps, "sleep actor", lambda: sleep_stage(groups.actor))
    return steps


def summarize(rollouts: list[list[Step]], flops: list[float], config: DistillConfig, peak: float | None) -> dict:
    """Per-rollout figures of some timed rollouts: seconds are means, memory the maximum (per rank)."""
    train, dmd2 = config.train, config.dmd2
    ranks, steps = range(train.world_size), [step for rollout in rollouts for step in rollout]

    def seconds(*names: str) -> float:
        return statistics.mean(sum(s.seconds for s in rollout if s.name in names) for rollout in rollouts)

    def step_peak(name: str, role: str) -> int:
        return max(max(s.peak[role]) for s in steps if s.name == name)

    whole = statistics.mean(sum(s.seconds for s in rollout) for rollout in rollouts)
    achieved = sum(flops) / train.world_size / (whole * len(rollouts))
    roles = list(steps[0].peak)
    device, at = max(((sum(s.peak[role][i] for role in roles), s.name) for s in steps for i in ranks),
                     key=lambda both: both[0])  # the first step at the peak
    used = [s.device_used for s in steps if s.device_used is not None]
    return {"seconds_per_rollout": whole,
            "seconds_per_critic_step": seconds("critic-train") / dmd2.critic_steps_per_rollout,
            "seconds_per_actor_step": seconds("actor-train") / dmd2.actor_steps_per_rollout,
            "seconds_rollout_stage": seconds("rollout"), "seconds_score": seconds("score"),
            "seconds_wake_sleep": seconds(*(s.name for s in steps if s.name.startswith(("wake", "sleep")))),
            "samples_per_second": train.rollout_batch_size / whole, "tflops_per_device": achieved / 1e12,
            "mfu": achieved / peak if peak else None,
            "group_peak": {role: [max(s.peak[role][i] for s in steps) for i in ranks] for role in roles},
            "device_peak": device, "device_peak_at": at if device else None,  # CPU ranks report 0: no step to name
            "device_used": max(used) if used else None,
            "steps": {s.name: {"seconds": seconds(s.name), "peak": {role: step_peak(s.name, role) for role in roles}}
                      for s in rollouts[0]}}


# -- one parallel mode ------------------------------------------------------------------------------

def measure(spec, store: ArtifactStore, args: argparse.Namespace, flops: dict[int, float], use: DeviceUse,
            peak: float | None) -> dict:
    """A warm-up rollout, timed rollouts with sleep, then without; the groups end with it."""
    config, world = spec.config, spec.config.train.world_size
    groups = build_groups(spec, store, num_threads=max(1, (os.cpu_count() or 1) // world))
    run, timed_ids = f"bench-{config.train.parallel}", range(1, 1 + args.rollouts)
    try:
        run_rollout_on_groups(groups, run, 0)  # warm-up: first-step allocations (AdamW state), kernel selection
        with_sleep = [instrumented_rollout(groups, run, r, True, use) for r in timed_ids]
        if groups.awake_roles():
            raise RuntimeError(f"groups {groups.awake_roles()} awake after a rollout with sleep: the bench's steps "
                               "no longer follow run_rollout_on_groups")
        asleep = {g.role: g.device_memory() for g in groups.in_order()}
        figures = {"sleep": summarize(with_sleep, [flops[r] for r in timed_ids], config, peak), "asleep": asleep}
        figures["no_sleep"] = no_sleep_figures(groups, run, args.rollouts, flops, use, config, peak)
    finally:
        groups.shutdown()
    peaks = figures["sleep"]["group_peak"]
    figures["device_peak_if_idle_asleep"] = max(peaks[role][i] + sum(asleep[o][i] for o in asleep if o != role)
                                                for role in peaks for i in range(world))
    return figures


def no_sleep_figures(groups: Groups, run: str, rollouts: int, flops: dict[int, float], use: DeviceUse,
                     config: DistillConfig, peak: float | None) -> dict:
    """Rollouts with no group ever asleep, after an untimed one that leaves both awake (both hold their
    gradients from then on); {"error": ...} when the device cannot hold both."""
    ids = range(2 + rollouts, 2 + 2 * rollouts)
    try:
        instrumented_rollout(groups, run, 1 + rollouts, False, use)
        timed_rollouts = [instrumented_rollout(groups, run, r, False, use) for r in ids]
    except Exception as error:  # Ray re-raises a rank's torch.OutOfMemoryError as its own error type
        if "out of memory" not in str(error).lower():
            raise
        return {"error": "out of memory"}
    return summarize(timed_rollouts, [flops[r] for r in ids], config, peak)


# -- main -----------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), help="default: sd35-medium with CUDA, else tiny")
    parser.add_argument("--tiny", action="store_true", help="--shape tiny")
    parser.add_argument("--parallel", nargs="+", choices=("ddp", "fsdp"), default=["ddp"])
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--critic-steps", type=int, default=2, help="K")
    parser.add_argument("--batch", type=int, default=2, help="B: samples per critic step per rank")
    parser.add_argument("--student-steps", type=int, default=4, help="N")
    parser.add_argument("--rollouts", type=int, default=2, help="timed rollouts with sleep, and again without")
    parser.add_argument("--precision", choices=("bf16", "no"), default="bf16", help="[train] mixed_precision")
    parser.add_argument("--workdir", type=Path, help="keeps the built pipeline for the next run (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    args.shape = "tiny" if args.tiny else args.shape or ("sd35-medium" if torch.cuda.is_available() else "tiny")
    if args.rollouts < 1:
        parser.error("--rollouts must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print its table and return the figures (also written to --json)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    peak = peak_flops(device) if device != "cpu" else None
    head = {"command": " ".join(["python -m bench.gpu", *argv]), "device": device, "peak_flops": peak}

    def write(result: dict) -> None:  # after each parallel mode: a run cut short keeps the modes it finished
        if args.json:
            args.json.write_text(json.dumps(head | result, indent=2) + "\n")

    started_ray = not ray.is_initialized()
    with tempfile.TemporaryDirectory() as tmp:
        teacher = build_teacher(SHAPES[args.shape], (args.workdir or Path(tmp)) / f"teacher-{args.shape}")
        prompts = Path(tmp) / "prompts.txt"
        prompts.write_text("\n".join(PROMPTS) + "\n")
        store = ArtifactStore((Path(tmp) / "store").as_uri())
        ensure_ray(num_cpus=max(os.cpu_count() or 1, 2 * args.world_size + 1))  # two groups of ranks, one task
        use = DeviceUse()
        try:
            result = head | run_modes(args, teacher, prompts, store, Path(tmp) / "cache", use, peak, write)
        finally:
            use.close()
            if started_ray:
                ray.shutdown()
    print(table(result), flush=True)
    return result


def run_modes(args: argparse.Namespace, teacher: Path, prompts: Path, store: ArtifactStore, cache: Path,
              use: DeviceUse, peak: float | None, write) -> dict:
    """Prepare the prompt table (as the distill flow does: once, then reused), count the FLOPs once,
    and measure each parallel mode, handing ``write`` the figures so far after each."""
    result, runs = {}, {}
    for parallel in args.parallel:
        config = recipe(teacher, prompts, args, parallel)
        family = family_for(config.model)
        family.check(config)
        config = family.resolve(config, cache)
        prepared, _ = prepare_inputs(family, config, store)
        spec = dataclasses.replace(family.run_spec(config, cache), prepared=prepared)
        if not result:
            result, flops = flop_figures(args, config, spec.sample_shape, teacher,
                                         load_prepared(store, prepared, cache)["prompts"])
        runs[parallel] = measure(spec, store, args, flops, use, peak)
        write(result | {"runs": runs})
    return result | {"runs": runs}


def flop_figures(args: argparse.Namespace, config: DistillConfig, sample_shape: tuple[int, ...], teacher: Path,
                 prompt_table: dict[str, torch.Tensor]) -> tuple[dict, dict[int, float]]:
    """The shape and FLOP figures of the table's head, and each rollout's FLOPs by rollout id."""
    text, pooled = tuple(prompt_table["prompt_embeds"].shape[1:]), prompt_table["pooled_prompt_embeds"].shape[-1]
    forward, both, params = count_flops(teacher, sample_shape, text, pooled, args.batch)
    stages = {r: rollout_flops(config, sample_shape, r, forward, both) for r in range(config.train.rollouts)}
    timed = [stages[r] for r in range(1, 1 + args.rollouts)]
    shape = {"name": args.shape, "parameters": params, "sample_shape": list(sample_shape),
             "resolution": config.data.resolution, "text": list(text), "precision": args.precision,
             "student_steps": args.student_steps, "critic_steps": args.critic_steps, "batch": args.batch,
             "world_size": args.world_size, "samples": config.train.rollout_batch_size, "rollouts": args.rollouts}
    flops = {"forward": forward, "forward_backward": both,
             "per_rollout_mean": {k: statistics.mean(s[k] for s in timed) for k in timed[0]}}
    return {"shape": shape, "flops": flops}, {r: sum(s.values()) for r, s in stages.items()}


if __name__ == "__main__":
    main()
