"""`dmd2 plan`: will a recipe fit the GPUs it is meant for? Each GPU's memory in every stage of a rollout,
predicted in this process before any server starts (infra/trainers/memory_plan.py), printed as a table with a
verdict; a recipe that does not fit exits 1 naming the stage, the figure and what to change."""

import argparse
import json
import logging
import math
import os
import re
from pathlib import Path

from dmd2.config import ConfigError, DistillConfig, load_recipe, parse_overrides
from dmd2.config_rules import SHARDED
from flows.recipe import DEFAULT_RECIPE, RECIPES

logger = logging.getLogger(__name__)
GiB = 2**30
UNITS = {"": GiB, "gib": GiB, "gb": 10**9, "mib": 2**20, "mb": 10**6, "tib": 2**40, "tb": 10**12}
TABLE_TITLE = ("GiB per GPU (one rank of each group), by what holds it, and the stage's compute per GPU; after the\n"
               "rollout's stages, what the run does now and then (evaluate: the student's samples; reference: the\n"
               "teacher's, at the first evaluation; checkpoint: the critic saving beside the actor):")
COLUMNS = (("weights", "weights"), ("gradients", "grads"), ("optimizer", "optim"), ("teacher", "teacher"),
           ("conditioning", "cond"), ("activations", "activ"), ("temporaries", "temp"))


def memory_size(text: str) -> int:
    """Bytes of a size such as 80GiB, 24 GiB, 80GB or 512MiB (a bare number is GiB)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size: write e.g. 80GiB, 24GiB or 40GB")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE, help=f"TOML recipe (default {DEFAULT_RECIPE})")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a recipe option, as on distill (repeatable)")
    parser.add_argument("--gpus", type=int, help="GPUs of the run: its [train] world_size, each GPU holding one rank "
                                                 "of each group (default: the recipe's world_size)")
    parser.add_argument("--gpu-memory", type=memory_size, required=True, metavar="SIZE",
                        help="memory of one GPU, e.g. 80GiB (H100/A100 80 GB), 141GiB (H200), 24GiB")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs per machine, for the host memory a node's sleeping "
                                                          "groups take (default: --gpus, at most 8; under hsdp, "
                                                          "[train] shard_group_size)")
    parser.add_argument("--gpu-tflops", type=float, default=989.0, metavar="TFLOPS",
                        help="a GPU's peak dense TFLOP/s in the recipe's compute precision, for the time per rollout "
                             "(default 989: an H100 SXM in bf16; an A100 312, an H200 989)")
    parser.add_argument("--mfu", type=float, default=0.4, metavar="FRACTION",
                        help="the share of --gpu-tflops the run is assumed to reach (default 0.4)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the plan here as JSON")


def planned_config(recipe: Path, overrides: list[str], gpus: int | None) -> DistillConfig:
    """The recipe with its overrides and `--gpus` as its world size; option checks only (no file is read: a plan
    needs no prompts, and no model weights)."""
    if not recipe.is_file():
        raise ConfigError(f"--recipe {recipe} does not exist (recipes are in {RECIPES})")
    parsed = parse_overrides(overrides)
    if gpus is not None:
        if gpus < 1:
            raise ConfigError(f"--gpus must be >= 1, got {gpus}")
        parsed.setdefault("train", {})["world_size"] = gpus
    try:
        return load_recipe(recipe, parsed)
    except ConfigError as error:
        if gpus is None or "world_size" not in str(error):
            raise
        raise ConfigError(f"--gpus {gpus} sets [train] world_size: {error}") from error


def cmd_plan(args: argparse.Namespace) -> int:
    config = planned_config(args.recipe, args.overrides, args.gpus)
    train = config.train
    node = train.shard_group_size if train.parallel == "hsdp" else min(train.world_size, 8)  # what a node holds
    gpus_per_node = node if args.gpus_per_node is None else args.gpus_per_node
    if gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node must be >= 1, got {gpus_per_node}")
    if not 0 < args.mfu <= 1 or not 0 < args.gpu_tflops < math.inf:
        raise ConfigError(f"--mfu must be in (0, 1] and --gpu-tflops a number > 0, got {args.mfu:g} and "
                          f"{args.gpu_tflops:g}")
    if args.json is not None and not args.json.parent.is_dir():  # refused now, not after a minute of planning
        raise ConfigError(f"--json {args.json}: its folder {args.json.parent} does not exist")
    from dmd2.family import family_for  # the bad input above is refused before torch loads
    from infra.trainers.memory_plan import RESERVE, plan_memory

    family = family_for(config.model)
    print(f"planning {args.recipe} on {train.world_size} GPU(s) of {args.gpu_memory / GiB:.0f} GiB: {layout(config)}; "
          f"B = {batch(config)} per critic step (rehearsing a rollout on fake tensors)...", flush=True)
    plan = plan_memory(family.plan_spec(config))
    usable = (1 - RESERVE) * args.gpu_memory
    print(table(plan))
    peak = plan.peak
    share = peak.peak / args.gpu_memory
    print(f"\npeak {peak.peak / GiB:.1f} GiB per GPU, in {peak.stage}: {share:.0%} of {args.gpu_memory / GiB:.0f} "
          f"GiB ({RESERVE:.0%} of each GPU is kept for the CUDA context, NCCL and fragmentation)")
    sharded = train.parallel in SHARDED
    print(f"host memory per node for sleeping groups: {plan.host_parked * gpus_per_node / GiB:.0f} GiB "
          f"({gpus_per_node} GPU(s) x {plan.host_parked / GiB:.1f} GiB); while the groups load, at most "
          f"{plan.host_loading(gpus_per_node, sharded) / GiB:.0f} GiB ({loading(sharded)}); to export, "
          f"{plan.host_export(sharded) / GiB:.1f} GiB more on the first node (the student "
          + ("gathered, and copied" if sharded else "copied from its GPU") + ")")
    seconds = rollout_seconds(plan, args.gpu_tflops, args.mfu)
    print(f"compute: {tflop(plan.flops_per_rollout)} TFLOP per GPU per rollout; at {args.mfu:.0%} MFU of "
          f"{args.gpu_tflops:g} TFLOP/s per GPU (--mfu, --gpu-tflops) a rollout computes for {duration(seconds)}, "
          f"the recipe's {train.rollouts} rollouts for {duration(train.rollouts * seconds)} (training alone: "
          "evaluation, checkpoints and sleep copies come on top)")
    together = plan.resident <= usable
    print(f"with nothing asleep (both groups and the teacher resident): {plan.resident / GiB:.1f} GiB per GPU: "
          + ('[train] sleep = "auto" keeps every group resident (no copies)' if together
             else '[train] sleep = "auto" sleeps each group after its stage'))
    fits = plan.fits(args.gpu_memory)
    if args.json:
        args.json.write_text(json.dumps(as_json(plan, config, args, fits, gpus_per_node), indent=1) + "\n")
    if fits:
        print(f"fits: {train.world_size} GPU(s) of {args.gpu_memory / GiB:.0f} GiB")
        return 0
    print(f"does not fit: {peak.stage} needs {peak.peak / GiB:.1f} GiB per GPU, more than the {usable / GiB:.1f} GiB "
          f"usable of {args.gpu_memory / GiB:.0f} GiB. To fit, {remedies(config, peak)}")
    return 1


def loading(sharded: bool) -> str:
    who = "rank 0 of each group" if sharded else "every rank"
    return f"{who} reading its models whole, the critic's the teacher too"


def rollout_seconds(plan, gpu_tflops: float, mfu: float) -> float:
    """A rollout's compute time: every GPU computes its share at once, so one GPU's FLOPs at ``mfu`` of its peak."""
    return plan.flops_per_rollout / (gpu_tflops * 1e12 * mfu)


def tflop(flops: int) -> str:
    return f"{flops / 1e12:,.0f}" if flops >= 1e14 else f"{flops / 1e12:.3g}"


def duration(seconds: float) -> str:
    for unit, size in (("h", 3600), ("min", 60), ("s", 1), ("ms", 1e-3)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds * 1e6:.3g} us"


def batch(config: DistillConfig) -> str:
    """B, and what one GPU holds of it: its samples, or under sequence parallelism its part of their tokens."""
    n = config.train.sequence_parallel
    if n == 1:
        return f"{config.critic_batch_size} samples per GPU"
    return f"{config.critic_batch_size} samples per {n} GPUs, each GPU holding 1/{n} of their tokens"


def layout(config: DistillConfig) -> str:
    train = config.train
    sharding = {"ddp": "DDP", "fsdp": "FSDP2",
                "hsdp": f"HSDP (FSDP2 over {train.shard_group_size} GPUs, {train.world_size // train.shard_group_size} "
                        "replicas)"}
    return ", ".join([sharding[train.parallel],
                      "bf16 compute" if train.mixed_precision == "bf16" else "fp32",
                      *(["activation checkpointing"] if train.activation_checkpointing else []),
                      *([f"sequence parallel over {train.sequence_parallel} GPUs"] if train.sequence_parallel > 1
                        else [])])


def table(plan) -> str:
    header = f"{'stage':13} {'peak':>7}" + "".join(f" {title:>7}" for _, title in COLUMNS) + f" {'TFLOP':>8}"
    rows = [f"{stage.stage:13} {stage.peak / GiB:7.2f}"
            + "".join(f" {stage.by_category.get(key, 0) / GiB:7.2f}" for key, _ in COLUMNS)
            + f" {tflop(plan.flops[stage.stage]) if stage.stage in plan.flops else '-':>8}"
            for stage in plan.stages]
    return "\n".join([TABLE_TITLE, header, *rows])


def splits_tokens(config: DistillConfig) -> bool:
    """Whether the recipe's family can split a sample's tokens over GPUs (`[train] sequence_parallel`)."""
    from dmd2.family import FAMILIES, family_name

    return "[train] sequence_parallel" in FAMILIES[family_name(config.model)].reads


def remedies(config: DistillConfig, peak) -> str:
    """What would shrink the peak stage, the largest part first."""
    if peak.stage in ("reference", "evaluate", "checkpoint"):
        return output_remedies(config, peak)
    train, parts = config.train, peak.by_category
    state = parts["weights"] + parts["gradients"] + parts["optimizer"]
    options = []
    if train.parallel == "ddp" and state > 0.2 * peak.peak:
        options.append((state, 'set [train] parallel = "fsdp" (shards weights, gradients and AdamW state over the '
                               'GPUs)'))
    if train.mixed_precision != "bf16":
        options.append((parts["activations"] + parts["teacher"],
                        'set [train] mixed_precision = "bf16" (bf16 compute and a bf16 teacher)'))
    if not train.activation_checkpointing and parts["activations"] > 0.1 * peak.peak:
        options.append((parts["activations"], "set [train] activation_checkpointing = true (recompute activations "
                                              "in backward)"))
    tokens = parts["activations"] + parts["temporaries"]
    if splits_tokens(config) and train.sequence_parallel < train.world_size and tokens > 0.3 * peak.peak:
        options.append((tokens / 2, f"raise [train] sequence_parallel (now {train.sequence_parallel}) to a divisor "
                                    "of world_size (each GPU then holds that share of every sample's tokens)"))
    options.sort(key=lambda option: -option[0])
    options.append((0, f"lower [train] rollout_batch_size (now {batch(config)} per critic step)"
                       + {"ddp": "", "fsdp": ", or plan more GPUs (--gpus)",
                          "hsdp": ", or shard over more GPUs ([train] shard_group_size)"}[train.parallel]))
    return "; or ".join(text for _, text in options)


def output_remedies(config: DistillConfig, peak) -> str:
    """What would shrink an evaluation (its samples taken at once, the teacher) or a checkpoint (both groups'
    state together)."""
    from dmd2.family import family_class, family_name

    train, options = config.train, []
    if peak.stage in ("reference", "evaluate"):
        family = family_class(family_name(config.model))
        samples = ("[eval] num_samples" if family.name == "digits"
                   else "[eval] samples_per_prompt or the number of [eval] prompts")
        options.append(f"lower {samples} (" + ("each GPU samples its share of them, at most its samples of a "
                                                 "rollout at once" if family.splits_evaluation else "the first GPU "
                                                 "samples them in one batch") + ")")
        if train.mixed_precision != "bf16":
            options.append('set [train] mixed_precision = "bf16" (bf16 compute and a bf16 teacher)')
    if train.parallel == "ddp":
        options.append('set [train] parallel = "fsdp" (shards weights and AdamW state over the GPUs)')
    else:
        options.append("plan more GPUs (--gpus: each then holds a smaller shard of the weights and AdamW state)")
    return "; or ".join(options)


def as_json(plan, config: DistillConfig, args: argparse.Namespace, fits: bool, gpus_per_node: int) -> dict:
    return {"recipe": str(args.recipe), "overrides": list(args.overrides), "world_size": config.train.world_size,
            "gpu_memory_bytes": args.gpu_memory, "fits": fits, "peak_stage": plan.peak.stage,
            "stages": {stage.stage: {"peak": stage.peak, **stage.by_category} for stage in plan.stages},
            "host_parked_per_gpu": plan.host_parked, "resident_peak": plan.resident,
            "host_per_node": plan.host_parked * gpus_per_node,
            "host_loading_per_node": plan.host_loading(gpus_per_node, config.train.parallel in SHARDED),
            "host_export": plan.host_export(config.train.parallel in SHARDED),
            "flops_per_gpu": plan.flops, "flops_per_rollout_per_gpu": plan.flops_per_rollout,
            "mfu": args.mfu, "gpu_tflops": args.gpu_tflops,
            "seconds_per_rollout": rollout_seconds(plan, args.gpu_tflops, args.mfu),
            "gpus_per_node": gpus_per_node, "teacher_parameters": plan.parameters}



# What a plan's figures depend on: the models, the batch layout, the algorithm's options and how [train] holds
# the models; not the schedule (rollouts, intervals, seed), the learning rates, evaluation or the registry.
PLANNED_SECTIONS = ("model", "student", "dmd2", "data", "train")
UNPLANNED_TRAIN = ("rollouts", "seed", "save_interval", "eval_interval", "keep_rollouts", "max_failures", "sleep")
PLAN_FORMAT = 8  # of the cached plans: a plan of another format is made again


def cached_plan(config: DistillConfig, family, cache_dir: Path):
    """`plan_memory` of the run, kept in ``<cache_dir>/plans/`` by what its figures depend on (`PLANNED_SECTIONS`,
    and the teacher's model configs): a rerun, resume or longer run of the same recipe plans in no time."""
    import hashlib

    from dmd2.config import config_to_dict
    from infra.trainers.memory_plan import MemoryPlan, plan_memory

    options = {section: values for section, values in config_to_dict(config).items() if section in PLANNED_SECTIONS}
    for name in UNPLANNED_TRAIN:
        options["train"].pop(name, None)
    teacher = Path(config.model.teacher)
    model_configs = sorted([*teacher.glob("*config.json"), *teacher.glob("*/config.json")]) if teacher.is_dir() else []
    digest = hashlib.sha256(json.dumps([PLAN_FORMAT, family.name, options], sort_keys=True, default=str).encode())
    for path in model_configs:
        digest.update(path.read_bytes())
    cached = Path(cache_dir) / "plans" / f"{digest.hexdigest()[:32]}.json"
    if cached.is_file():
        return MemoryPlan.from_dict(json.loads(cached.read_text()))
    logger.info("planning the run's memory per GPU: rehearsing a rollout on fake tensors (once per recipe; SD3.5 "
                "takes about a minute)")
    plan = plan_memory(family.plan_spec(config))
    cached.parent.mkdir(parents=True, exist_ok=True)
    staged = cached.with_suffix(f".{os.getpid()}.tmp")
    staged.write_text(json.dumps(plan.to_dict()))
    os.replace(staged, cached)
    return plan


def fit_to_cluster(config: DistillConfig, family, cache_dir: Path, memory: tuple[str | None, int]) -> DistillConfig:
    """The run's config for the cluster it is about to use, asked before any group starts or MLflow run is made:
    `ConfigError` naming the stage, the figure and the fix if its plan does not fit (per GPU against the GPUs Ray
    reports when the ranks take GPUs; with CPU ranks on a local Ray, all of them against this machine's available
    memory), and `[train] sleep = "auto"` decided (`resolve_sleep`). `memory`: `rank_memory`'s answer, asked
    before the ranks took the GPUs."""
    from infra.trainers.memory_plan import RESERVE

    kind, capacity = memory
    if kind is None:  # CPU ranks on a joined cluster: its nodes' memory is not known here
        return resolve_sleep(config, None, kind, capacity)
    plan = cached_plan(config, family, cache_dir)
    peak, ranks = plan.peak, config.train.world_size
    hint = f"(`dmd2 plan --gpu-memory {capacity / GiB:.0f}GiB` shows every stage)"
    if kind == "GPU" and not plan.fits(capacity):
        raise ConfigError(
            f"this run does not fit its GPUs: {peak.stage} needs {peak.peak / GiB:.1f} GiB per GPU, more than the "
            f"{(1 - RESERVE) * capacity / GiB:.1f} GiB usable of the {capacity / GiB:.0f} GiB GPUs Ray reports. To "
            f"fit, {remedies(config, peak)} {hint}")
    need = ranks * plan.host_rank_pair
    logger.info("memory plan: peak %.2f GiB per GPU in %s; %s %.1f GiB", peak.peak / GiB, peak.stage,
                "GPUs of" if kind == "GPU" else f"{ranks} CPU rank pair(s) need {need / GiB:.2f} GiB of the available",
                capacity / GiB)
    if kind == "host" and need > (1 - RESERVE) * capacity:
        raise ConfigError(
            f"this run does not fit this machine's memory: its {ranks} CPU rank pair(s) need {need / GiB:.1f} GiB "
            f"({plan.host_rank_pair / GiB:.1f} GiB each: both groups' weights and optimizer state, the teacher, and "
            f"{peak.stage}'s {peak.peak / GiB:.1f} GiB at its peak), more than the "
            f"{(1 - RESERVE) * capacity / GiB:.1f} GiB usable of the {capacity / GiB:.1f} GiB available. To fit, "
            f"{remedies(config, peak)}; or run on GPUs")
    return resolve_sleep(config, plan, kind, capacity)


def resolve_sleep(config: DistillConfig, plan, kind: str | None, capacity: int) -> DistillConfig:
    """`[train] sleep = "auto"` decided: "never" (no copies) when both groups and the teacher fit a GPU together
    (`MemoryPlan.resident`) and for CPU ranks (what sleeps stays in the same memory: nothing to gain), else
    "always"; any other value as it is."""
    from infra.trainers.memory_plan import RESERVE

    if config.train.sleep != "auto":
        return config
    together = kind == "host" or (kind == "GPU" and plan.resident <= (1 - RESERVE) * capacity)
    logger.info("[train] sleep = auto: %s", "never (both groups fit together)" if together else "always")
    return config.replace("train", sleep="never" if together else "always")
