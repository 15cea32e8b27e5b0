"""Model families: everything that depends on the kind of model distilled, behind one contract.

A family knows how to resolve and load the recipe's teacher, student and critic, which component
trains, the sample shape, where conditionings come from, the velocity call, how to evaluate a
student (scores and media) and how to export it. The rest of the tree (the trainer groups, the
tasks, the flows, the CLI) is written against `ModelFamily` alone; it never imports a family's code.
The recipe names the family (`[model] family`), or the family is inferred from the teacher, and
`family_for` resolves it here, in one place (docs/architecture.md, "Model families").

Where each part runs:
    CLI, before heavy imports   `claims`, `check`: the family's checks module, standard library only,
                                so a refused recipe costs no torch import (flows/preflight.py); this
                                module imports no torch either, and names each family's code by path
    driver, before any server   `resolve` (e.g. pretrain and cache a built-in teacher), `run_spec`,
                                `prepared_key` (cheap: read configs and files, never weights)
    a Ray worker, once per run  `prepare` (e.g. encode the prompts); the result is stored under
                                `prepared_key` and reused by later runs with the same inputs
    a rank of a trainer group   `bind` (the prepared inputs), `real_source`, `load_model`, `velocity`,
                                `evaluator` (rank 0), `export` (rank 0)
    where an export is served   `student_generator`, `generate` (its pictures: what the student's MLflow
                                model, infra/tracking/student_model.py, calls)
"""

from __future__ import annotations  # torch, numpy and the model code appear in annotations only

import argparse
import dataclasses
import importlib
import os
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol

from dmd2.config import ConfigError, DistillConfig, ModelConfig

if TYPE_CHECKING:  # importing this module stays light: the registry serves the CLI before torch loads
    import numpy as np
    import torch
    from torch import Tensor, nn

    from dmd2.conditioning import CondSource
    from dmd2.gan import GanTap, RealSource
    from dmd2.model import VelocityFn


@dataclass(frozen=True)
class Registration:
    """Where one family's code is, by dotted path, imported only when asked for: choosing a family imports
    no other, and refusing a recipe imports no family's heavy code."""

    family: str  # "module:Class", the ModelFamily; it imports torch and diffusers, so only a run loads it
    # A module importing only the standard library (and dmd2.config), with `claims(teacher) -> bool` and
    # `check(config)`: what the CLI and flows/preflight.py ask before anything heavy loads. The family's
    # own `claims` and `check` are these functions.
    checks: str
    commands: str | None = None  # "module:NAME", the family's CLI commands (a list of `Command`), light too
    # "module:Class", a judge of RGB pictures the family offers other families' evaluators: `[eval] feature_model =
    # "builtin:<family>"` (`Class.load(cache_dir)`, then `features(images)` and `classify(images)`).
    judge: str | None = None
    # Which of `FAMILY_OPTIONS` it reads (its checks module refuses the values its models do not allow); set, the
    # others are refused for it (`check_family`).
    reads: tuple[str, ...] = ()


# Options only some families read: "[section] option" -> (its unset value, why a family that does not read it can't).
FAMILY_OPTIONS = {
    "[train] sequence_parallel": (1, "its model cannot split its tokens over ranks"),  # diffusers' `_cp_plan`
    "[student] expert": ("", "its teacher has no experts to choose from"),  # Wan 2.2 A14B's two
    "[dmd2] teacher_true_cfg_scale": (1.0, "its teacher's guidance is CFG already ([dmd2] teacher_guidance_scale)"),
}


FAMILIES = {
    "digits": Registration("dmd2.families.digits.family:DigitsFamily", "dmd2.families.digits.checks",
                           "dmd2.families.digits.commands:COMMANDS", judge="dmd2.families.digits.judge:DigitsJudge"),
    "sd3": Registration("dmd2.families.sd3.family:SD3Family", "dmd2.families.sd3.checks",
                        "dmd2.families.sd3.commands:COMMANDS"),
    "wan": Registration("dmd2.families.wan.family:WanFamily", "dmd2.families.wan.checks",
                        reads=("[train] sequence_parallel", "[student] expert")),
    "flux": Registration("dmd2.families.flux.family:FluxFamily", "dmd2.families.flux.checks",
                         reads=("[dmd2] teacher_true_cfg_scale", "[train] sequence_parallel")),
    "qwen_image": Registration("dmd2.families.qwen_image.family:QwenImageFamily", "dmd2.families.qwen_image.checks",
                               reads=("[train] sequence_parallel",)),
    "flux2_klein": Registration("dmd2.families.flux.klein.family:Flux2KleinFamily", "dmd2.families.flux.klein.checks"),
}


def default_cache_dir() -> Path:
    """Where families cache what they build once (a pretrained built-in teacher, an evaluator)."""
    return Path(os.environ.get("DMD2_CACHE", Path.home() / ".cache" / "dmd2"))


@dataclass(frozen=True)
class Evaluation:
    """One evaluation of a student: `eval/...` scores, and media: uint8 pictures (H x W or H x W x C) or videos
    (F x H x W x C, `dmd2.media.is_video`), which the driver logs as mp4s with a strip of frames beside them."""

    scores: dict[str, float]
    media: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


class Evaluator(Protocol):
    """Built once per run on the rank that evaluates (reference statistics are not cheap), for its device."""

    def evaluate(self, student: VelocityFn) -> Evaluation:
        """Score the student (its velocity call) and make its media."""

    def baselines(self) -> list[tuple[str, dict[str, float]]]:
        """Reference rows scored the same way (e.g. the teacher at many and at few steps)."""

    def reference_media(self) -> dict[str, np.ndarray]:
        """Pictures logged once at the start, beside the student's (e.g. the teacher's own grid)."""

    def references_id(self) -> str:
        """Names what `references` depend on: stored ones are handed back only to an evaluator of the same id."""

    def references(self) -> dict[str, Tensor]:
        """What the evaluator makes once per run and the rank stores (e.g. the teacher's samples); {}: nothing."""

    def with_references(self, tensors: dict[str, Tensor]) -> None:
        """Take `references` stored earlier in the run instead of making them again (a replaced rank process)."""


class SplitEvaluator(Evaluator, Protocol):
    """An evaluator whose sampling the ranks share (`ModelFamily.splits_evaluation`): each rank samples its share
    of the student's and of the teacher's samples, and rank 0 scores them all."""

    def student_share(self, student: VelocityFn, rank: int, world_size: int) -> Tensor:
        """The student's samples of rank ``rank``'s share, as the whole evaluation would sample them."""

    def teacher_share(self, rank: int, world_size: int) -> dict[str, Tensor]:
        """The teacher's samples of rank ``rank``'s share; every rank's, concatenated, go to `with_references`."""

    def has_references(self) -> bool:
        """Whether the teacher's samples are here already (made, or handed in)."""

    def score(self, samples: Tensor) -> Evaluation:
        """The evaluation of the student's samples of every share, in rank order."""


@dataclass(frozen=True)
class Command:
    """A family's own CLI command (`dmd2 <name>`), e.g. the digits family's `pretrain`."""

    name: str
    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class RunSpec:
    """What every trainer group of a run shares: the recipe, its family, the sample shape ([C, H, W] for pictures,
    [C, F, H, W] for videos: the algorithm reads any rank), the conditioning source, and the cache directory the
    family may use on the ranks."""

    config: DistillConfig
    family: ModelFamily
    sample_shape: tuple[int, ...]
    conds: CondSource
    cache_dir: str
    # Where the family's prepared inputs are (a store reference, opaque here); None when it needs none.
    prepared: Any = None
    # The GAN's real samples (`[dmd2] critic_gan_weight`) when the driver makes them (digits: a data set in
    # memory); a family that prepares them (SD3: encoded images) gives them after `bind`, see `real_source`.
    real: RealSource | None = None


class ModelFamily:
    """The contract every family implements (subclasses are small frozen dataclasses, so they pickle
    to Ray ranks). Methods with a body here are defaults that suit a plain diffusers model, except
    `claims`, `check` and `commands`: those are the family's registration's (`FAMILIES`), kept apart
    from the class so that the CLI can ask them without importing it; a family does not override them."""

    name: ClassVar[str]
    # The score that decides whether one student beats another, and its direction (None: no score does,
    # so no student of the family is promoted in the model registry).
    gate_metric: ClassVar[str | None] = None
    gate_lower_is_better: ClassVar[bool] = True
    # `generate`'s inputs for an example (class labels, prompts) and the shape of one picture or video it makes
    # (-1: set by the settings): the logged student model's input example and signature.
    generate_example: ClassVar[tuple[Any, ...]] = ()
    generated_shape: ClassVar[tuple[int, ...]] = ()
    # Score keys -> column headings of the eval table the CLI prints.
    report_columns: ClassVar[dict[str, str]] = {}
    # The distances to the teacher's samples (lower is closer) by judges that share no model: a quality claim is
    # made only when they agree (`dmd2.report.judges_verdict`). Score keys -> headings.
    judges: ClassVar[dict[str, str]] = {}
    # The layers `[student] lora_rank` adapts (peft `target_modules`: module names or name suffixes); empty:
    # the family trains no LoRA (dmd2/lora.py).
    lora_targets: ClassVar[tuple[str, ...]] = ()
    # Whether every rank samples a share of an evaluation with the model as it holds it (its evaluator is a
    # `SplitEvaluator`), rather than rank 0 all of it with a whole copy: for models whose sampling is long.
    splits_evaluation: ClassVar[bool] = False

    @classmethod
    def claims(cls, teacher: str) -> bool:
        """Whether `[model] teacher = teacher` is a model of this family (read configs only): its checks module's."""
        return family_checks(cls.name).claims(teacher)

    @classmethod
    def commands(cls) -> list[Command]:
        """Extra CLI commands the family offers (its registration names them)."""
        return family_commands(cls.name)

    def check(self, config: DistillConfig) -> None:
        """Refuse, with a `ConfigError` naming the option and the fix, what this family cannot run: its checks
        module's `check`, the very code the CLI runs before anything heavy loads."""
        check_family(self.name, config)

    def resolve(self, config: DistillConfig, cache_dir: Path) -> DistillConfig:
        """The config with every model spec loadable by `load_model` (a directory or a hub id)."""
        return config

    def run_spec(self, config: DistillConfig, cache_dir: Path) -> RunSpec:
        raise NotImplementedError

    def prepared_key(self, config: DistillConfig) -> str | None:
        """A digest naming what `prepare` makes from this config (its inputs' contents), or None if nothing."""
        return None

    def prepare(self, config: DistillConfig, part: tuple[int, int] = (0, 1)) -> dict[str, dict[str, Tensor]]:
        """The once-per-run inputs, as named tensor tables (e.g. the encoded prompts); with ``part`` = (i, n) the i-th
        of n parts that n workers make at once (`[data] prepare_workers`): the prompt table's rows of that part
        (`dmd2.prompt_index.table_part`; {} when it has none), and everything else in part 0."""
        raise NotImplementedError

    def merge_prepared(self, parts: list[dict[str, dict[str, Tensor]]]) -> dict[str, dict[str, Tensor]]:
        """`prepare`'s inputs whole from its parts, in order: what one worker makes. Here the tables of "prompts"
        are concatenated (`dmd2.prompt_index.merge_tables`) and the rest is part 0's."""
        from dmd2.prompt_index import merge_tables

        return {**parts[0], "prompts": merge_tables([part.get("prompts", {}) for part in parts])}

    def bind(self, prepared: dict[str, dict[str, Tensor]], device: torch.device | str = "cpu") -> ModelFamily:
        """This family holding the prepared inputs on `device` (on the ranks, before any model call:
        moved there once, so no model call copies them)."""
        return self

    def load_model(self, path: str, dtype: torch.dtype | None = None) -> nn.Module:
        """The component that trains (and the frozen teacher's), loaded from a directory or hub id.

        `dtype`: the dtype the rank trains or holds the model in (e.g. the frozen teacher in bf16 under
        `[train] mixed_precision = "bf16"`), loaded straight into it; None is the family's default (fp32)."""
        raise NotImplementedError

    def trained_part(self, model: nn.Module, role: str, config: DistillConfig) -> nn.Module:
        """What group ``role`` (`actor`, `critic`) trains of its loaded init (`load_model`): all of it by default."""
        return model

    def model_on_meta(self, path: str, dtype: torch.dtype | None = None) -> nn.Module:
        """`load_model(path, dtype)`'s architecture on the meta device, made from its config alone (no weight is
        read): what `dmd2 plan` gives fake storage and measures."""
        from dmd2.model import architecture

        return architecture(path, dtype)

    def plan_spec(self, config: DistillConfig) -> RunSpec:
        """The run's spec for `dmd2 plan`: the sample shape and the conditioning, without reading the run's data
        or preparing anything (`plan_bind` stands in for the prepared inputs)."""
        return self.run_spec(config, default_cache_dir())

    def plan_bind(self, config: DistillConfig, device: torch.device | str) -> "ModelFamily":
        """This family bound (`bind`) to prepared inputs of their real shapes, zero-filled (fake under `dmd2 plan`)."""
        return self.bind({}, device)

    def evaluation_batch(self, config: DistillConfig, teacher: bool = False) -> int:
        """How many samples an evaluation runs through the student (or for its reference samples, the teacher) at
        once on the GPU that samples the most, from the options alone: what `dmd2 plan` rehearses."""
        raise NotImplementedError

    def conditioning_tensors(self) -> list[Tensor]:
        """The tensors the bound family keeps on the device (prepared conditioning, real samples): `dmd2 plan`
        counts them as conditioning."""
        return []

    def real_source(self, spec: RunSpec) -> RealSource | None:
        """The GAN's real samples on a rank, asked of the bound family (`bind`): the driver's `spec.real` unless
        the family keeps them in its prepared inputs. None: the run has none."""
        return spec.real

    def gan_tap(self, model: nn.Module) -> GanTap:
        """Where the critic's GAN head reads its features (`[dmd2] critic_gan_weight`, dmd2/gan.py)."""
        raise NotImplementedError(f"the {self.name} family has no GAN head: set [dmd2] critic_gan_weight = 0")

    def velocity(self, model: nn.Module) -> VelocityFn:
        """The model's velocity call for `(x_s, sigma, cond)`."""
        from dmd2.model import DiffusersVelocity

        return DiffusersVelocity(model)

    def evaluator(self, config: DistillConfig, cache_dir: Path, device: torch.device | str = "cpu") -> Evaluator:
        """The run's evaluator, for a rank on ``device`` (its models go there)."""
        raise NotImplementedError

    def export(self, student: nn.Module, config: DistillConfig, out_dir: Path, card: dict[str, Any]) -> None:
        """Write the student into `out_dir` (which does not exist yet) so that users load it with diffusers.

        `card`: teacher, recipe, run_id, rollouts, scores (the last evaluation's)."""
        raise NotImplementedError

    def generation_settings(self, config: DistillConfig) -> dict[str, Any]:
        """How `generate` samples this run's export (JSON values; kept with the logged student model)."""
        return {"num_steps": config.student.num_steps, "shift": config.student.grid_shift}

    def student_generator(self, student_dir: Path, settings: dict[str, Any]) -> StudentGenerator:
        """The export in `student_dir`, loaded once, as a call from inputs to pictures or videos (a served model's)."""
        raise NotImplementedError

    def generate(self, student_dir: Path, inputs: list[Any], settings: dict[str, Any],
                 seed: int = 0) -> list[np.ndarray]:
        """uint8 pictures (H x W or H x W x C) or videos (F x H x W x C) of the exported student, one per input (a
        class label, a prompt)."""
        return self.student_generator(student_dir, settings)(inputs, seed)


class StudentGenerator(Protocol):
    def __call__(self, inputs: list[Any], seed: int = 0) -> list[np.ndarray]:
        """One uint8 picture (or video) per input; the same inputs and seed give the same pixels."""


def _registration(name: str) -> Registration:
    if name not in FAMILIES:
        raise ConfigError(f"[model] family = {name!r} is not a model family; choose one of {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_class(name: str) -> type[ModelFamily]:
    """The family's class (imports its models' code: torch, diffusers)."""
    return pkgutil.resolve_name(_registration(name).family)


def family_checks(name: str) -> ModuleType:
    """The family's checks module: `claims(teacher)` and `check(config)`, importing no heavy code."""
    return importlib.import_module(_registration(name).checks)


def check_family(name: str, config: DistillConfig) -> None:
    """Family ``name``'s checks of ``config`` (its checks module's `check`), after refusing the `FAMILY_OPTIONS` it
    does not read."""
    for key, (unset, lacking) in FAMILY_OPTIONS.items():
        section, option = key[1:].split("] ")
        value = getattr(getattr(config, section), option, unset)  # an absent section ([dmd2]) sets nothing
        if value != unset and key not in _registration(name).reads:
            able = sorted(family for family, registration in FAMILIES.items() if key in registration.reads)
            raise ConfigError(f"{key} = {value!r}: not read by the {name} family, {lacking} (families that read it: "
                              f"{', '.join(able)}); set it to {unset!r}")
    family_checks(name).check(config)


def family_commands(name: str) -> list[Command]:
    commands = _registration(name).commands
    return list(pkgutil.resolve_name(commands)) if commands else []


def family_judge(name: str) -> type:
    """The picture judge family ``name`` offers (`Registration.judge`): how another family's evaluator reads pictures
    with it (`[eval] feature_model = "builtin:<name>"`) without importing that family's code."""
    judge = _registration(name).judge
    if judge is None:
        raise ConfigError(f"[eval] feature_model = 'builtin:{name}': the {name} family offers no picture judge")
    return pkgutil.resolve_name(judge)


def family_name(model: ModelConfig) -> str:
    """The family the recipe names in `[model] family`, else the one that claims `[model] teacher` (light)."""
    if model.family:
        _registration(model.family)  # refuses a name that is not registered
        return model.family
    for name in FAMILIES:
        if family_checks(name).claims(model.teacher):
            return name
    missing = "" if Path(model.teacher).exists() else " (no such file or directory)"
    raise ConfigError(f"no model family recognises [model] teacher = {model.teacher!r}{missing} (families: "
                      f"{sorted(FAMILIES)}); point it at a model or pipeline directory of one of them, or for a "
                      "hub id set [model] family")


def checked_family(config: DistillConfig) -> str:
    """The name of the family that runs `config`, once its checks passed (light: no family's models load)."""
    name = family_name(config.model)
    check_family(name, config)
    return name


def family_for(model: ModelConfig) -> ModelFamily:
    """The family the recipe names in `[model] family`, else the one that claims `[model] teacher`."""
    return family_class(family_name(model))()


def all_commands() -> list[Command]:
    """Every family's CLI commands (light: for building the CLI's parser)."""
    return [command for name in FAMILIES for command in family_commands(name)]
