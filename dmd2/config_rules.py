"""Which option values and combinations a recipe may hold (docs/architecture.md §1's rules), checked when
a `dmd2.config.DistillConfig` is made, before any work; each message names the option and the fix.

The choices of the options that name a kind of computation live here too, not beside the code that
runs them (dmd2/critic.py, dmd2/precision.py, dmd2/scoring.py, which import them), so that a recipe
is validated without importing torch: a refused recipe costs no heavy import (flows/preflight.py).
"""

import dataclasses
import types
import typing
from dataclasses import field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dmd2.config import DistillConfig


def option(default: Any, doc: str) -> Any:
    """A recipe option: its default and its doc (the option reference page is generated from the docs)."""
    return field(default=default, metadata={"doc": doc})


LOSS_TYPES = ("dmd2", "flow_matching")
LOSS_SPACES = ("velocity", "x0")  # [dmd2] critic_loss_space
SIGMA_SAMPLINGS = ("uniform", "logit_normal")  # [dmd2] critic_sigma_sampling
PRECISIONS = ("no", "bf16")  # [train] mixed_precision
CRITIC_SCORING_MODES = ("fused", "original")  # [dmd2] critic_scoring
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD")  # [cluster] placement_strategy
PARALLELISMS = ("ddp", "fsdp", "hsdp")  # [train] parallel
SHARDED = ("fsdp", "hsdp")  # the parallelisms under which a rank holds shards (FSDP2)
SLEEPS = ("always", "never", "auto")  # [train] sleep
BUILTIN_FEATURE_MODELS = ("builtin:digits",)  # [eval] feature_model: the built-in ones (else a model directory)


class ConfigError(ValueError):
    """An invalid option; the message names it and the fix."""


def type_error(annotation: Any, value: Any) -> str | None:
    """Why `value` is not of the option's type, or None when it is (TOML has int, float, str, bool, arrays)."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
        else (annotation,)
    for option in options:
        if option is type(None) and value is None:
            return None
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return None
        if option in (int, str, bool) and type(value) is option:
            return None
        if typing.get_origin(option) is tuple and isinstance(value, (list, tuple)):
            kinds = typing.get_args(option)
            if len(kinds) == 2 and kinds[1] is Ellipsis:
                kinds = (kinds[0],) * len(value)
            if len(value) == len(kinds) and all(type_error(k, v) is None for k, v in zip(kinds, value)):
                return None
    names = " or ".join(getattr(o, "__name__", str(o)).replace("NoneType", "unset") for o in options)
    return f"expected {names}, got {value!r}"


def section_from_table(name: str, cls: type, values: dict[str, Any], source: str) -> Any:
    """The section dataclass `cls` of a recipe's table `[name]`: unknown keys and values of the wrong type are
    refused naming them (`source`: the recipe), TOML arrays become tuples."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"{source}: unknown option(s) {', '.join(f'[{name}] {k}' for k in unknown)}; "
                          f"[{name}] takes {', '.join(known)}")
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        problem = type_error(hints[key], value)
        if problem:
            raise ConfigError(f"{source}: [{name}] {key}: {problem}")
    converted = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**converted)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(config: "DistillConfig") -> None:
    """Raise `ConfigError` for the first option of `config` that breaks a rule."""
    train, optim, student = config.train, config.optim, config.student
    _check(train.loss_type in LOSS_TYPES, f"[train] loss_type must be one of {LOSS_TYPES}, got {train.loss_type!r}")
    _check(student.num_steps >= 1, f"[student] num_steps must be >= 1, got {student.num_steps}")
    _check(student.shift is None or student.shift > 0, f"[student] shift must be > 0, got {student.shift}")
    _check(0 <= student.ema_decay < 1,
           f"[student] ema_decay must be in [0, 1) (0 turns the EMA off), got {student.ema_decay}")
    _validate_lora(config)
    _check(optim.lr > 0, f"[optim] lr must be > 0, got {optim.lr}")
    _check(optim.critic_lr is None or optim.critic_lr > 0, f"[optim] critic_lr must be > 0, got {optim.critic_lr}")
    _check(len(optim.betas) == 2 and all(0 <= b < 1 for b in optim.betas),
           f"[optim] betas must be two numbers in [0, 1), got {optim.betas}")
    _check(optim.grad_clip >= 0, f"[optim] grad_clip must be >= 0 (0 disables it), got {optim.grad_clip}")
    _check(0 <= optim.decay_fraction <= 1,
           f"[optim] decay_fraction must be in [0, 1] (0: no decay), got {optim.decay_fraction}")
    _check(train.rollouts >= 1, f"[train] rollouts must be >= 1, got {train.rollouts}")
    _check(train.world_size >= 1, f"[train] world_size must be >= 1, got {train.world_size}")
    _check(train.save_interval >= 0 and train.eval_interval >= 0,
           "[train] save_interval and eval_interval must be >= 0 (0: only at the end)")
    _check(train.mixed_precision in PRECISIONS,
           f"[train] mixed_precision must be one of {PRECISIONS}, got {train.mixed_precision!r}")
    _check(train.parallel in PARALLELISMS, f"[train] parallel must be one of {PARALLELISMS}, got {train.parallel!r}")
    _check(train.shard_group_size >= 1, f"[train] shard_group_size must be >= 1 (a node's GPUs), got "
                                        f"{train.shard_group_size}")
    _check(train.parallel != "hsdp" or train.world_size % train.shard_group_size == 0,
           f"[train] world_size ({train.world_size}) must be a multiple of shard_group_size "
           f"({train.shard_group_size}) with parallel = \"hsdp\": set shard_group_size to the GPUs of one node")
    _check(train.sleep in SLEEPS, f"[train] sleep must be one of {SLEEPS}, got {train.sleep!r}")
    _check(not (train.compile and train.activation_checkpointing),
           "[train] compile does not work with activation_checkpointing yet: the recomputation of a compiled block "
           "meets a recompiled graph (torch.utils.checkpoint's CheckpointError, pytorch/pytorch#166926); set one "
           "of them to false")
    cluster = config.cluster
    _check(cluster.gpus_per_rank is None or cluster.gpus_per_rank >= 0,
           f"[cluster] gpus_per_rank must be >= 0 (0: CPU ranks), got {cluster.gpus_per_rank}")
    _check(cluster.cpus_per_rank is None or cluster.cpus_per_rank > 0,
           f"[cluster] cpus_per_rank must be > 0, got {cluster.cpus_per_rank}")
    _check(cluster.placement_strategy in PLACEMENT_STRATEGIES,
           f"[cluster] placement_strategy must be one of {PLACEMENT_STRATEGIES}, got {cluster.placement_strategy!r}")
    _check(config.data.resolution >= 0, f"[data] resolution must be >= 0 (0: the model's default), got "
                                         f"{config.data.resolution}")
    for option in ("frames", "height", "width"):
        value = getattr(config.data, option)
        _check(value >= 0, f"[data] {option} must be >= 0 (0: the model's default), got {value}")
    _check(config.data.prepare_workers >= 0, f"[data] prepare_workers must be >= 0 (0: one per GPU of the cluster), "
                                             f"got {config.data.prepare_workers}")
    _check(1 <= config.data.max_sequence_length <= 512, f"[data] max_sequence_length must be in 1..512 (T5 "
           f"tokens per prompt; SD3's default 256), got {config.data.max_sequence_length}")
    _check(train.keep_rollouts >= 0,
           f"[train] keep_rollouts must be >= 0 (0: delete each rollout's artifacts once it is done), "
           f"got {train.keep_rollouts}")
    _check(train.max_failures >= 0, f"[train] max_failures must be >= 0 (0: never recover), got {train.max_failures}")
    _validate_sequence_parallel(config)
    _check(train.rollout_batch_size % train.data_ranks == 0,
           f"[train] rollout_batch_size ({train.rollout_batch_size}) must split evenly over "
           f"{_data_ranks(train)}")
    _validate_eval(config)
    if train.loss_type == "dmd2":
        _validate_dmd2(config)
    else:
        _check(config.dmd2 is None, f"[dmd2] options are read only with [train] loss_type = 'dmd2' "
                                    f"(got {train.loss_type!r}): remove the [dmd2] section")
        _check(optim.critic_lr is None, "[optim] critic_lr is read only under DMD2 (there is no critic): remove it")
        _check(config.model.critic_load is None,
               "[model] critic_load is read only under DMD2 (there is no critic): remove it")


def _data_ranks(train) -> str:
    if train.sequence_parallel == 1:
        return f"world_size ({train.world_size}) ranks"
    return (f"the {train.data_ranks} data-parallel ranks (world_size {train.world_size} / sequence_parallel "
            f"{train.sequence_parallel})")


def _validate_sequence_parallel(config: "DistillConfig") -> None:
    """`[train] sequence_parallel`'s rules that need no model (its heads and tokens: the family's checks)."""
    train, dmd2 = config.train, config.dmd2
    n = train.sequence_parallel
    _check(n >= 1, f"[train] sequence_parallel must be >= 1 (1: off), got {n}")
    _check(train.world_size % n == 0,
           f"[train] sequence_parallel ({n}) must divide world_size ({train.world_size}): each sample's tokens are "
           "split over that many ranks of a group; set world_size to a multiple of it")
    _check(n == 1 or dmd2 is None or (dmd2.gan_weight == 0 and dmd2.critic_gan_weight == 0),
           "[dmd2] gan_weight / critic_gan_weight do not work with [train] sequence_parallel > 1 yet (the GAN head "
           "would read one rank's part of the critic's tokens): set them to 0 or sequence_parallel = 1")


def _validate_eval(config: "DistillConfig") -> None:
    evaluation = config.eval
    _check(evaluation.samples_per_prompt >= 2,
           f"[eval] samples_per_prompt must be >= 2 (noises per eval prompt: diversity compares a prompt's samples "
           f"with each other), got {evaluation.samples_per_prompt}")
    model = evaluation.feature_model
    _check(not model.startswith("builtin:") or model in BUILTIN_FEATURE_MODELS,
           f"[eval] feature_model = {model!r} is no built-in feature model: use one of {BUILTIN_FEATURE_MODELS}, a "
           "transformers CLIP or DINOv2 directory or hub id, or leave it unset (the model-free pixel KID only)")


def _validate_lora(config: "DistillConfig") -> None:
    student = config.student
    _check(student.lora_rank >= 0, f"[student] lora_rank must be >= 0 (0: full fine-tuning), got {student.lora_rank}")
    if student.lora_rank == 0:
        _check(student.lora_alpha is None and not student.critic_lora,
               "[student] lora_alpha and critic_lora are read only with lora_rank > 0: set lora_rank or remove them")
        return
    _check(student.lora_alpha is None or student.lora_alpha > 0,
           f"[student] lora_alpha must be > 0 (default: lora_rank), got {student.lora_alpha}")
    _check(not student.critic_lora or config.train.loss_type == "dmd2",
           "[student] critic_lora is read only under DMD2 (there is no critic): remove it")


def _validate_dmd2(config: "DistillConfig") -> None:
    dmd2, train = config.dmd2, config.train
    _check(dmd2 is not None, "[train] loss_type = 'dmd2' needs a [dmd2] section (an empty one takes the defaults)")
    _check(bool(config.model.teacher), "[model] teacher is required for DMD2: a diffusers model directory, "
                                       "hub id, builtin:digits or builtin:digits-sd3")
    _check(dmd2.teacher_guidance_scale >= 1,
           f"[dmd2] teacher_guidance_scale must be >= 1 (1 = unguided), got {dmd2.teacher_guidance_scale}")
    _check(dmd2.teacher_true_cfg_scale >= 1,
           f"[dmd2] teacher_true_cfg_scale must be >= 1 (1 = none), got {dmd2.teacher_true_cfg_scale}")
    low, high = dmd2.score_sigma_range
    _check(0 <= low < high <= 1, f"[dmd2] score_sigma_range must satisfy 0 <= min < max <= 1, got {(low, high)}")
    weights, steps = dmd2.stop_weights, config.student.num_steps
    _check(not weights or (len(weights) == steps and min(weights) >= 0 and sum(weights) > 0),
           f"[dmd2] stop_weights must be empty (uniform) or {steps} weights >= 0, one per student step "
           f"([student] num_steps), not all 0; got {list(weights)}")
    _check(config.student.guidance_scale == 1.0, "[student] guidance_scale must be 1 under DMD2: the student "
                                                 "learns the guided teacher and samples unguided")
    _check(dmd2.actor_steps_per_rollout == 1,
           f"[dmd2] actor_steps_per_rollout must be 1 (one generator update per K critic updates), "
           f"got {dmd2.actor_steps_per_rollout}")
    _check(dmd2.critic_steps_per_rollout >= 1,
           f"[dmd2] critic_steps_per_rollout must be >= 1, got {dmd2.critic_steps_per_rollout}")
    shard = train.rollout_batch_size // train.data_ranks
    per_rank = "world_size" if train.sequence_parallel == 1 else "(world_size / sequence_parallel)"
    _check(shard % dmd2.critic_steps_per_rollout == 0 and shard > 0,
           f"[dmd2] critic_steps_per_rollout ({dmd2.critic_steps_per_rollout}) must divide each rank's shard "
           f"of {shard} samples ([train] rollout_batch_size / {per_rank}): change either")
    _check(dmd2.critic_loss_space in LOSS_SPACES,
           f"[dmd2] critic_loss_space must be one of {LOSS_SPACES}, got {dmd2.critic_loss_space!r}")
    _check(dmd2.critic_scoring in CRITIC_SCORING_MODES,
           f"[dmd2] critic_scoring must be one of {CRITIC_SCORING_MODES}, got {dmd2.critic_scoring!r}")
    _check(dmd2.sigma_shift is None or dmd2.sigma_shift > 0, f"[dmd2] sigma_shift must be > 0, got {dmd2.sigma_shift}")
    _check(dmd2.critic_sigma_sampling in SIGMA_SAMPLINGS,
           f"[dmd2] critic_sigma_sampling must be one of {SIGMA_SAMPLINGS}, got {dmd2.critic_sigma_sampling!r}")
    _check(dmd2.gan_weight >= 0, f"[dmd2] gan_weight must be >= 0 (0: no GAN loss), got {dmd2.gan_weight}")
    _check(dmd2.critic_gan_weight >= 0,
           f"[dmd2] critic_gan_weight must be >= 0 (0: no discriminator), got {dmd2.critic_gan_weight}")
    _check(dmd2.gan_weight == 0 or dmd2.critic_gan_weight > 0,
           f"[dmd2] gan_weight = {dmd2.gan_weight} needs a trained discriminator: set critic_gan_weight > 0 "
           "(e.g. 1e-2), or gan_weight = 0")
