"""The digits family: a class-conditional UNet2DModel on sklearn's 8x8 digits, the built-in default.

Teacher `builtin:digits` is pretrained and cached on first use; any `save_pretrained` directory of a
class-conditional digits UNet (1 x 8 x 8, ten classes plus the null class) is one too. Conditioning
is a class label per sample (the null class is CFG's negative); evaluation is the digits yardstick;
the export is the student's `save_pretrained` directory with a model card.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dmd2.conditioning import ClassLabels
from dmd2.config import DistillConfig
from dmd2.family import ModelFamily, RunSpec
from dmd2.families.digits.checks import BUILTIN_DIGITS, IMAGE_SHAPE, NULL_CLASS, NUM_CLASSES
from dmd2.families.digits.data import real_digits
from dmd2.gan import GanTap
from dmd2.model import load_pretrained

LORA_DIR = "lora"  # a LoRA student's adapter, inside its export


@dataclass(frozen=True)
class DigitsFamily(ModelFamily):
    name = "digits"
    gate_metric = "eval/fd_teacher"
    report_columns = {"eval/fd_real": "FD vs real", "eval/fd_teacher": "FD vs teacher 32-step",
                      "eval/pixel_kid_teacher": "pixel KID vs teacher", "eval/accuracy": "class accuracy"}
    judges = {"eval/fd_teacher": "FD (evaluator's features)", "eval/pixel_kid_teacher": "pixel KID"}
    generate_example = (0, 1, 2, 3)  # class labels
    generated_shape = IMAGE_SHAPE[1:]
    # The mid block's attention, every resnet's convs and its timestep projection (a few-step student reads
    # the timestep anew); the UNet's in/out convs, norms and embeddings stay the teacher's.
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2", "time_emb_proj")

    def resolve(self, config: DistillConfig, cache_dir: Path) -> DistillConfig:
        from dmd2.families.digits.pretrain import resolve_model  # pretraining imports diffusers and sklearn

        model = config.model
        return config.with_teacher_shift(1.0).replace(  # the digits teacher samples an unshifted grid
            "model",
            family=self.name,
            teacher=resolve_model(model.teacher, cache_dir),
            student=model.student and resolve_model(model.student, cache_dir),
            critic_load=model.critic_load and resolve_model(model.critic_load, cache_dir),
        )

    def run_spec(self, config: DistillConfig, cache_dir: Path) -> RunSpec:
        gan = config.dmd2 is not None and config.dmd2.critic_gan_weight > 0
        return RunSpec(config, self, IMAGE_SHAPE, ClassLabels(NUM_CLASSES, NULL_CLASS), str(cache_dir),
                       real=real_digits() if gan else None)

    def model_on_meta(self, path: str, dtype: torch.dtype | None = None) -> nn.Module:
        """The built-in teacher's architecture needs no pretraining to be measured."""
        from diffusers import UNet2DModel

        from dmd2.families.digits.model import DIGITS_UNET_CONFIG
        from dmd2.model import on_meta

        if path == BUILTIN_DIGITS:
            return on_meta(UNet2DModel, DIGITS_UNET_CONFIG, dtype)
        return super().model_on_meta(path, dtype)

    def gan_tap(self, model: nn.Module) -> GanTap:
        """The UNet's bottleneck: `mid_block`'s output, [B, C, h, w] with C its last block's channels."""
        return GanTap("mid_block", model.config.block_out_channels[-1])

    def load_model(self, path: str, dtype: torch.dtype | None = None) -> nn.Module:
        try:
            return load_pretrained(path, dtype)
        except (OSError, ValueError) as exc:
            raise FileNotFoundError(f"cannot load a diffusers model from {path!r} ({exc}); [model] teacher / "
                                    "student / critic_load must name a save_pretrained directory") from exc

    def evaluator(self, config: DistillConfig, cache_dir: Path, device: torch.device | str = "cpu"):
        """The yardstick runs on the host (the digits models are small); the student's calls go to ``device``."""
        from dmd2.families.digits.evaluation import DigitsStudentEvaluator

        return DigitsStudentEvaluator.build(config, cache_dir)

    def evaluation_batch(self, config: DistillConfig, teacher: bool = False) -> int:
        """The yardstick's samples, in one batch on rank 0, or the grid's after them if it is larger."""
        from dmd2.families.digits.evaluation import GRID_LABELS

        return max(config.eval.num_samples, len(GRID_LABELS))

    def export(self, student: nn.Module, config: DistillConfig, out_dir: Path, card: dict[str, Any]) -> None:
        """The UNet's `save_pretrained` directory; a LoRA student's is the merged UNet, with its adapter alone
        in `lora/` (peft's format, over the student's init: `PeftModel.from_pretrained(teacher, out_dir / "lora")`)."""
        from dmd2.lora import has_adapters, merged_copy, save_peft_adapter

        adapted = has_adapters(student)
        (merged_copy(student) if adapted else student).save_pretrained(out_dir, safe_serialization=True)  # creates it
        if adapted:
            save_peft_adapter(student, out_dir / LORA_DIR, config.model.student or config.model.teacher)
        (out_dir / "README.md").write_text(model_card(config, card))

    def student_generator(self, student_dir: Path, settings: dict[str, Any]):
        from dmd2.families.digits.generation import DigitsGenerator

        model = self.load_model(str(student_dir)).eval().requires_grad_(False)
        return DigitsGenerator(model, int(settings["num_steps"]), float(settings["shift"]))


def _lora_note(config: DistillConfig) -> str:
    student = config.student
    if not student.lora_rank:
        return ""
    return (f"\n\nTrained as LoRA adapters (rank {student.lora_rank}, alpha {student.adapter_alpha}); this UNet has "
            f"them merged. The adapter alone is in `{LORA_DIR}/` (peft's format): "
            f"`PeftModel.from_pretrained(base_unet, \"{LORA_DIR}\")` over the student's initial UNet.")


def model_card(config: DistillConfig, card: dict[str, Any]) -> str:
    """A diffusers model card: what the student is, how to sample it, and its eval figures."""
    scores = "\n".join(f"| `{key}` | {value:.4f} |" for key, value in sorted(card.get("scores", {}).items()))
    steps = config.student.num_steps
    return f"""---
library_name: diffusers
tags: [dmd2, distillation, digits]
---
# DMD2 digits student ({steps} steps)

Distilled with DMD2 from the digits teacher `{card.get("teacher", config.model.teacher)}` (recipe
`{card.get("recipe", "")}`, run `{card.get("run_id", "")}`, {card.get("rollouts", "?")} rollouts). Sample it with
the student's sampler: predict x0 and re-noise to the next sigma of the grid [1, (N-1)/N, ..., 1/N],
N = {steps}, unguided; class labels 0..9 (10 is the null class).{_lora_note(config)}

| eval | value |
|---|---:|
{scores}
"""
