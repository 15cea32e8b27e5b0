"""Configuration: one frozen dataclass per concern, every field documented, validated before any work
(the rules: `dmd2.config_rules`).

A recipe is a TOML file whose sections match the dataclasses: [model], [student], [optim], [dmd2],
[train], [cluster], [data], [eval]. Field docs live in `metadata["doc"]`; the option reference page is generated from
them. Every error names the option and what to change.
"""

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dmd2.guard_config import GuardConfig
from dmd2.config_rules import (CRITIC_SCORING_MODES, LOSS_SPACES, LOSS_TYPES, PARALLELISMS,  # noqa: F401
                               PLACEMENT_STRATEGIES, PRECISIONS, SIGMA_SAMPLINGS, ConfigError, option,
                               section_from_table, type_error, validate)


@dataclass(frozen=True)
class ModelConfig:
    """Where the models come from."""

    family: str = option("", "Model family (`digits`); default: inferred from the teacher.")
    teacher: str = option("", "Teacher: a diffusers model directory (or hub id), `builtin:digits` (class labels) "
                               "or `builtin:digits-sd3` (an SD3 pipeline that takes prompts).")
    student: str | None = option(None, "Student initialisation; default: the teacher's weights.")
    critic_load: str | None = option(None, "Critic initialisation (DMD2 only); default: the teacher.")


@dataclass(frozen=True)
class StudentConfig:
    """The student's few-step sampler."""

    num_steps: int = option(4, "N, the student's steps: grid [1, (N-1)/N, ..., 1/N] before the shift.")
    shift: float | None = option(None, "Time shift of the student's grid; default: the teacher's (SD3: its "
                                       "scheduler's `shift`; digits: 1, none).")
    guidance_scale: float = option(1.0, "CFG of the student's rollouts; DMD2 students are unguided (1).")
    ema_decay: float = option(0.0, "Decay of an exponential moving average of the student's weights, updated "
                                   "after each of its optimizer steps (e.g. 0.999: about the last 1000 steps); "
                                   "evaluation and export then use the average. 0: off, the raw weights.")
    lora_rank: int = option(0, "Rank r of LoRA adapters (Hu et al. 2021) on the family's attention and conv "
                               "layers: only they train, over the frozen weights of the student's init (the "
                               "teacher's); checkpoints hold the adapters only and the export adds them alone "
                               "(`<student>/lora/`) beside the merged model. 0: full fine-tuning.")
    lora_alpha: int | None = option(None, "LoRA alpha: the adapters' output is scaled by alpha / r; default: "
                                          "`lora_rank` (scale 1).")
    critic_lora: bool = option(False, "The DMD2 critic trains LoRA adapters of the same rank too (over its "
                                      "init's weights); false: the critic is fully fine-tuned.")
    expert: str = option("", "Wan 2.2 A14B (two experts): the student is one of them, `transformer` (the "
                             "high-noise expert) or `transformer_2` (low noise), initialised from it and used at every "
                             "step of its grid, so its export is a one-transformer WanPipeline; the critic and the "
                             "teacher keep both. Empty: the student keeps both, each sample answered by the expert of "
                             "its timestep.")

    @property
    def grid_shift(self) -> float:
        return 1.0 if self.shift is None else self.shift

    @property
    def adapter_alpha(self) -> int:
        return self.lora_rank if self.lora_alpha is None else self.lora_alpha


@dataclass(frozen=True)
class OptimConfig:
    """AdamW for the student (actor) and the critic."""

    lr: float = option(2e-6, "Student learning rate.")
    critic_lr: float | None = option(None, "Critic learning rate (DMD2 only); default: `lr`.")
    betas: tuple[float, float] = option((0.0, 0.999), "AdamW betas (the flow DMD2 recipes use beta1 = 0).")
    weight_decay: float = option(0.0, "AdamW weight decay.")
    grad_clip: float = option(1.0, "Max gradient norm per step; 0 disables clipping.")
    warmup_steps: int = option(0, "Linear learning-rate warmup, in optimizer steps.")
    decay_fraction: float = option(
        0.0, "The last this fraction of the run's rollouts decay both learning rates linearly towards 0 "
             "(warmup-stable-decay), so the final weights are not one noisy step's; 0: constant to the end."
    )


@dataclass(frozen=True)
class DMD2Config:
    """Distribution matching distillation (Yin et al. 2024)."""

    critic_steps_per_rollout: int = option(5, "K: critic updates per generator update (two time-scale rule).")
    actor_steps_per_rollout: int = option(1, "Generator updates per rollout; DMD2 takes exactly 1.")
    teacher_guidance_scale: float = option(4.5, "CFG of the teacher's real score (>= 1).")
    teacher_true_cfg_scale: float = option(
        1.0, "The flux family only: true CFG over [data] negative_prompt on top of the guidance input of the teacher's "
        "real score (FluxPipeline's `true_cfg_scale`; >= 1, 1: none)."
    )
    score_sigma_range: tuple[float, float] = option(
        (0.02, 0.98), "Unshifted sigma range of the scored samples (tianweiy/DMD2's 2-98%)."
    )
    stop_weights: tuple[float, ...] = option(
        (), "Backward simulation's odds of each of the student's N steps as the one a sample stops at and trains "
            "on (N weights, e.g. [1, 2, 3, 4]: the last step 4x the first); empty: uniform, as in DMD2."
    )
    critic_loss_space: str = option("velocity", "Space of the critic's loss: `velocity` or `x0`.")
    critic_scoring: str = option(
        "fused", "`fused`: score from the critic's last training forward; `original`: separate draw before it."
    )
    sigma_shift: float | None = option(None, "Shift of the critic's training sigmas; default: the teacher's "
                                             "(SD3: its scheduler's `shift`; digits: 1, none).")
    critic_sigma_sampling: str = option(
        "uniform", "The critic's training sigmas before the shift: `uniform`, or `logit_normal` (SD3's own "
        "training distribution, Esser et al. 2024, sigmoid of a standard normal)."
    )
    gan_weight: float = option(
        0.0, "Weight of the student's GAN loss L_G = mean softplus(-D(x_fake)) (DMD2 §4.3: D is a small head on "
        "the critic's middle features; its gradient is formed on the critic side at scoring); 0: off. Needs "
        "critic_gan_weight > 0. tianweiy/DMD2's generator weights: ImageNet 3e-3, SDXL 5e-3."
    )
    critic_gan_weight: float = option(
        0.0, "Weight of the discriminator loss L_D = mean softplus(-D(x_real)) + mean softplus(D(x_fake)) in "
        "every critic step (real samples from the family, noised like the student's; the head trains with the "
        "critic, at its lr, and is checkpointed with it); 0: off, no head. tianweiy/DMD2's: 1e-2 (ImageNet "
        "and SDXL)."
    )

    @property
    def critic_shift(self) -> float:
        return 1.0 if self.sigma_shift is None else self.sigma_shift


@dataclass(frozen=True)
class TrainConfig:
    """The run: how many rollouts, how big, on how many ranks."""

    loss_type: str = option("dmd2", "`dmd2`, or `flow_matching` (plain fine-tuning, no critic).")
    rollouts: int = option(100, "Rollouts (generator updates) to run.")
    rollout_batch_size: int = option(320, "Samples per rollout over all ranks (K * B * world_size / "
                                                  "sequence_parallel).")
    world_size: int = option(1, "Ranks per trainer group (data-parallel, times `sequence_parallel`).")
    seed: int = option(0, "Seed of every random draw; the same seed replays the same run.")
    save_interval: int = option(0, "Checkpoint every this many rollouts; 0: only at the end.")
    eval_interval: int = option(0, "Evaluate every this many rollouts; 0: only at the end.")
    mixed_precision: str = option("no", "`bf16`: bf16 compute with fp32 master weights and optimizer state, the "
                                        "frozen teacher held in bf16; `no`: fp32 throughout. On a GPU fp32 matmuls run in "
                                        "TF32.")
    parallel: str = option("ddp", "`ddp`: every rank holds the whole model, gradients averaged; `fsdp`: FSDP2 shards "
                                  "parameters, gradients and optimizer state over the ranks, block by block (for "
                                  "models that do not fit a GPU several times over); `hsdp`: FSDP2 shards over each "
                                  "group of `shard_group_size` ranks (a node) and replicates across the groups, so "
                                  "gathers stay inside a node.")
    shard_group_size: int = option(8, "With `parallel = \"hsdp\"`: the ranks that shard one copy of each model, "
                                      "normally a node's GPUs; world_size must be a multiple of it.")
    sequence_parallel: int = option(1, "N: each sample's tokens split over N ranks of a group (Ulysses: attention "
                                       "exchanges the token split for a head split), for samples whose activations "
                                       "do not fit one GPU (videos, large pictures); the N ranks hold the same "
                                       "samples, so a group trains on world_size / N data-parallel shards. N divides "
                                       "world_size, the model's attention heads and its tokens per sample; only "
                                       "families whose transformer has a context-parallel plan (wan, flux, "
                                       "qwen_image). 1: off.")
    activation_checkpointing: bool = option(False, "Recompute each block's activations in backward instead of "
                                                   "keeping them (diffusers' gradient checkpointing): less memory, "
                                                   "about a third more compute per step.")
    compile: bool = option(False, "Compile each transformer block with torch.compile (as torchtitan does): fused "
                                  "kernels, faster steps once compiled; the first rollouts pay the compilation "
                                  "(minutes at full size). On CPU it needs a C++ compiler.")
    sleep: str = option("always", "`always`: a group parks its weights and optimizer state in host memory after its "
                                  "stage, and the teacher is on the device only while scoring (one group's state on a "
                                  "GPU at a time); `never`: everything stays resident (no copies); `auto`: `never` "
                                  "when `dmd2 plan` says both groups and the teacher fit the run's devices together, "
                                  "else `always` (decided by the distill flow before the groups start).")
    keep_rollouts: int = option(
        2, "Rollouts whose artifacts stay in the store (the newest); older ones are deleted as the run goes, "
        "checkpoints never. Set it >= rollouts to keep them all."
    )
    max_failures: int = option(3, "Times a run recovers in place from a lost rank (its process died, or its "
                                   "collectives broke): new trainer groups load the last checkpoint and the run "
                                   "goes on. Past it the run fails with the cause; 0: never recover.")

    @property
    def data_ranks(self) -> int:
        """The ranks that hold different samples: the sequence ranks of one group share theirs."""
        return self.world_size // self.sequence_parallel


@dataclass(frozen=True)
class ClusterConfig:
    """What each rank asks Ray for."""

    gpus_per_rank: float | None = option(None, "GPUs per rank of each group; default: 1 when the Ray cluster has "
                                               "GPUs, else 0 (CPU ranks).")
    cpus_per_rank: float | None = option(None, "CPUs per rank of each group (Ray's logical CPUs); default: 1, or on "
                                               "a local Ray (no RAY_ADDRESS) with fewer CPUs than the run has ranks "
                                               "(world size x groups), an equal share of them: the ranks then share "
                                               "the machine's cores.")
    colocate: bool = option(True, "Actor and critic rank i share bundle i's GPUs in one process (the peak is the "
                                  "largest group, as each sleeps after use); false: each rank gets its own.")
    placement_strategy: str = option("PACK", "Ray placement of the ranks' bundles: PACK, SPREAD or STRICT_SPREAD.")




@dataclass(frozen=True)
class DataConfig:
    """Where a text-to-image family's prompts and real images come from (digits draws class labels instead)."""

    prompts: str = option("", "Training prompts: a text file (one a line) or JSONL with a `prompt` field; "
                                  "a relative path in a recipe is read beside the recipe.")
    negative_prompt: str = option("", "The negative prompt of the teacher's CFG (default: the empty prompt).")
    resolution: int = option(0, "Image side in pixels; 0: the pipeline's default (the transformer's sample "
                                "size times the VAE's scale factor).")
    max_sequence_length: int = option(256, "SD3: T5 tokens per prompt (padded to this; 256 is the pipeline's "
                                           "default, up to 512). The student samples with the same length.")
    frames: int = option(0, "Video: frames per sample; 0: the family's default (Wan: 81; its VAE takes 4k + 1 "
                            "frames).")
    height: int = option(0, "Video: height in pixels; 0: `resolution` when set (the square shorthand), else the "
                            "family's default (Wan: 480).")
    width: int = option(0, "Video: width in pixels; 0: `resolution` when set, else the family's default (Wan: 832).")
    prepare_workers: int = option(0, "Text families: Ray workers that encode the prompts at once, each a part of "
                                     "them on a GPU of its own where the cluster has GPUs; 0: one per GPU of the "
                                     "cluster (one without GPUs). The table is the same whatever their number.")
    images: str = option("", "SD3: a folder of real images (png, jpg, jpeg, webp) for the GAN's discriminator, "
                             "required by `[dmd2] critic_gan_weight` > 0; a same-named `.txt` beside an image is "
                             "its caption (else the empty prompt). Center-cropped, resized to `resolution` and "
                             "encoded once by the teacher's VAE. A relative path in a recipe is read beside the recipe.")


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation of the student (the family's: the digits yardstick, or SD3's distances, diversity and grid)."""

    num_samples: int = option(1000, "Digits: samples generated per evaluation (balanced over classes).")
    reference_steps: int = option(32, "Euler steps of the teacher's reference samples (digits: fidelity FD; "
                                      "SD3: what the KIDs compare the student's samples with, and the teacher's "
                                      "grid).")
    prompts: tuple[str, ...] = option((), "SD3: the fixed eval prompts (each sampled `samples_per_prompt` "
                                          "times); default: the first four of [data] prompts.")
    clip_model: str = option("", "SD3: a transformers CLIPModel directory (or hub id); set, the mean CLIP "
                                 "score of the student's eval samples is logged too.")
    feature_model: str = option("", "SD3: the vision model whose features the distance to the teacher's samples "
                                    "(`eval/kid_teacher`, then the gate) and the diversity are computed on: a "
                                    "transformers CLIPModel or DINOv2 directory (or hub id) with its image "
                                    "processor, or `builtin:digits` (the digits classifier, on the pictures "
                                    "area-downsampled to 8 x 8 grey; adds `eval/prompt_accuracy`). Unset: no "
                                    "feature-space distance; the model-free pixel KID (`eval/pixel_kid_teacher`, "
                                    "always logged) is the gate and diversity is measured on pixels.")
    samples_per_prompt: int = option(4, "SD3: each eval prompt is sampled from this many noises (the same ones "
                                        "every evaluation), so that the student's diversity can be measured; >= 2.")


@dataclass(frozen=True)
class RegistryConfig:
    """The MLflow model registry: each run's student as a version, the best one under the alias `champion`."""

    register: bool = option(True, "Log the exported student as an MLflow model and register it as a version.")
    model_name: str = option("", "The registered model's name; default: the run id.")


@dataclass(frozen=True)
class DistillConfig:
    """A whole recipe."""

    model: ModelConfig = field(default_factory=ModelConfig)
    student: StudentConfig = field(default_factory=StudentConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dmd2: DMD2Config | None = field(default_factory=DMD2Config)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)

    def __post_init__(self):
        validate(self)

    @property
    def critic_lr(self) -> float:
        return self.optim.critic_lr if self.optim.critic_lr is not None else self.optim.lr

    @property
    def critic_batch_size(self) -> int:
        """B: samples per critic step per rank (the actor trains on the last B of each rank's shard)."""
        return self.train.rollout_batch_size // self.train.data_ranks // self.dmd2.critic_steps_per_rollout

    def with_teacher_shift(self, shift: float) -> "DistillConfig":
        """Unset shifts (the student's grid, the critic's sigmas) become the teacher's `shift`."""
        config = self if self.student.shift is not None else self.replace("student", shift=shift)
        if config.dmd2 is not None and config.dmd2.sigma_shift is None:
            config = config.replace("dmd2", sigma_shift=shift)
        return config

    def replace(self, section: str, **changes: Any) -> "DistillConfig":
        """A copy with some options of one section changed (validated again)."""
        return dataclasses.replace(self, **{section: dataclasses.replace(getattr(self, section), **changes)})


SECTION_TYPES = {"model": ModelConfig, "student": StudentConfig, "optim": OptimConfig,
                 "dmd2": DMD2Config, "train": TrainConfig, "cluster": ClusterConfig, "data": DataConfig,
                 "eval": EvalConfig, "registry": RegistryConfig, "guard": GuardConfig}


def config_from_dict(data: dict[str, Any], source: str = "config") -> DistillConfig:
    """Build a config from nested dicts (a parsed TOML recipe); unknown sections or keys are errors."""
    unknown = sorted(set(data) - set(SECTION_TYPES))
    if unknown:
        raise ConfigError(f"{source}: unknown section(s) {unknown}; sections are {list(SECTION_TYPES)}")
    sections = {name: section_from_table(name, SECTION_TYPES[name], values, source) for name, values in data.items()}
    if "dmd2" not in sections and sections.get("train", TrainConfig()).loss_type != "dmd2":
        sections["dmd2"] = None  # no critic: a [dmd2] section would be read by nothing
    return DistillConfig(**sections)


# The recipe's own paths to files it ships with: relative ones are read beside the recipe, so a recipe and its
# prompt file work from any working directory (a `--set` path stays relative to the working directory, as a
# shell's argument is).
RECIPE_RELATIVE_PATHS = (("data", "prompts"), ("data", "images"))


def _beside_the_recipe(data: dict[str, Any], recipe: Path) -> None:
    for section, key in RECIPE_RELATIVE_PATHS:
        value = data.get(section, {}).get(key) if isinstance(data.get(section), dict) else None
        if isinstance(value, str) and value and "://" not in value and not Path(value).is_absolute():
            data[section][key] = str(recipe.resolve().parent / value)


def load_recipe(path: str | Path, overrides: dict[str, dict[str, Any]] | None = None) -> DistillConfig:
    """Read a TOML recipe; `overrides` ({section: {option: value}}, see `parse_overrides`) win over the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe {path} does not exist; pass a TOML file such as recipes/digits-4step.toml")
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as error:  # its message ends "(at line L, column C)"
        raise ConfigError(f"{path} is not valid TOML: {error}; fix that line") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"recipe {path} cannot be read as UTF-8 text ({error}); save it as UTF-8 TOML") from None
    _beside_the_recipe(data, path)
    for section, values in (overrides or {}).items():
        data.setdefault(section, {}).update(values)
    return config_from_dict(data, source=str(path) + (" with --set overrides" if overrides else ""))


def parse_overrides(assignments: list[str], option: str = "--set") -> dict[str, dict[str, Any]]:
    """`["train.rollouts=50", "model.teacher=/models/t"]` -> {"train": {"rollouts": 50}, "model": {...}}.

    A value is read as a TOML value (`50`, `3e-5`, `true`, `[0.0, 0.999]`, `"text"`); for an option
    whose type is a string, a bare word is the string itself. Sections and options must exist; types
    are checked when the recipe is built, like the file's.
    """
    parsed: dict[str, dict[str, Any]] = {}
    for assignment in assignments:
        target, sep, text = assignment.partition("=")
        section, dot, key = target.strip().partition(".")
        if not sep or not dot or not key:
            raise ConfigError(f"{option} {assignment!r}: write SECTION.KEY=VALUE, e.g. {option} train.rollouts=50")
        if section not in SECTION_TYPES:
            raise ConfigError(f"{option} {assignment!r}: no section [{section}]; sections are {list(SECTION_TYPES)}")
        hints = typing.get_type_hints(SECTION_TYPES[section])
        if key not in hints:
            raise ConfigError(f"{option} {assignment!r}: [{section}] has no option {key!r}; it takes "
                              f"{', '.join(hints)}")
        try:
            value = tomllib.loads(f"value = {text.strip()}")["value"]
        except tomllib.TOMLDecodeError:
            value = text.strip()  # a bare word: only a string option takes it (checked with the recipe)
        if type_error(hints[key], value) and type_error(hints[key], text.strip()) is None:
            value = text.strip()  # e.g. --set model.teacher=123 for a string option
        parsed.setdefault(section, {})[key] = value
    return parsed


def config_to_dict(config: DistillConfig) -> dict[str, Any]:
    """Nested plain dict of every option (for logging as params and for checkpoints)."""
    return {name: dataclasses.asdict(getattr(config, name)) for name in SECTION_TYPES
            if getattr(config, name) is not None}
