"""Export a distilled student as a complete diffusers pipeline directory of the teacher's class.

The teacher's text encoders, tokenizers and VAE are copied file by file; the student's transformer replaces the
teacher's (LoRA merged; the adapter alone in `lora/`, in the layout the pipeline's `save_lora_weights` writes, so that
`load_lora_weights` loads it onto the teacher); the scheduler is the family's, set so that the stock pipeline at the
student's step count samples exactly as the project's student sampler (dmd2/rollout.py `backward_simulate` run to
the end): at each sigma of the student's grid predict x0 = x_s - sigma v, then re-noise it to the next with fresh
noise. The directory is built in a hidden sibling and renamed into place, so it is either absent or complete.
"""

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from dmd2.flow_pipeline.files import SCHEDULER_CLASS, present
from dmd2.lora import adapter_config, adapter_state, has_adapters, merged_copy
from dmd2.pipeline_files import CHECKPOINT_SUFFIXES
from dmd2.schedule import student_sigmas

CARD_KEYS = ("base_model", "license", "recipe", "metrics")
LORA_DIR = "lora"  # a LoRA student's adapter alone, beside the merged transformer


@dataclass(frozen=True)
class CardText:
    """What a family's model card says of its pipeline: `title` (e.g. "Stable Diffusion 3"), the diffusers
    `pipeline` class, hub `tags`, the `parts` sentence (what was copied, what trained), the example `call`'s extra
    arguments (e.g. 'guidance_scale=1.0') and the `sampling` paragraph's guidance sentence."""

    title: str
    pipeline: str
    tags: tuple[str, ...]
    parts: str
    call: str
    guidance: str


def copy_teacher_parts(teacher_dir: Path, staging: Path, index: dict[str, Any], replaced: tuple[str, ...]) -> None:
    """Copy every present component but the `replaced` ones, and the top-level side files (licence, notes); skip
    single-file checkpoints that hub snapshots keep next to the pipeline."""
    for name in index:
        if name.startswith("_") or name in replaced or not present(index, name):
            continue
        if not (teacher_dir / name).is_dir():
            raise ValueError(f"[model] teacher {teacher_dir}: model_index.json lists {name} but {teacher_dir / name} "
                             f"is missing; complete the download of the pipeline")
        shutil.copytree(teacher_dir / name, staging / name)  # symlinks (a hub cache) are copied as files
    for file in teacher_dir.iterdir():
        if file.is_file() and file.name not in ("model_index.json", "README.md") \
                and not file.name.endswith(CHECKPOINT_SUFFIXES):
            shutil.copy2(file, staging / file.name)


def save_lora(pipeline_class: str, transformer: nn.Module, out_dir: Path) -> None:
    """The transformer's LoRA adapter alone, as diffusers' LoRA training scripts save it (peft-format keys,
    `transformer.` prefix, the LoraConfig as metadata): `<pipeline_class>.load_lora_weights(out_dir)` loads it onto
    the pipeline the student started from."""
    import diffusers  # slow to import; only exports need it

    getattr(diffusers, pipeline_class).save_lora_weights(
        out_dir, transformer_lora_layers=adapter_state(transformer),
        transformer_lora_adapter_metadata=adapter_config(transformer).to_dict())


def export_pipeline(teacher_dir: Path, index: dict[str, Any], transformer: nn.Module, scheduler: Any,
                    out_dir: Path, readme: Any) -> Path:
    """Write the student's pipeline into `out_dir` (which must not exist yet); return it. `scheduler`: the built
    scheduler (checked by the caller); `readme(lora_config or None) -> str`: the model card."""
    if out_dir.exists():
        raise FileExistsError(f"export: {out_dir} already exists; remove it or export to a new directory")
    staging = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)  # what a crashed earlier export left
    try:
        staging.mkdir(parents=True)
        copy_teacher_parts(teacher_dir, staging, index, ("transformer", "scheduler"))
        model = getattr(transformer, "module", transformer)  # DDP and FSDP wrappers keep the model in .module
        adapted = has_adapters(model)
        (merged_copy(model) if adapted else model).save_pretrained(staging / "transformer", safe_serialization=True)
        if adapted:
            save_lora(index["_class_name"], model, staging / LORA_DIR)
        scheduler.save_pretrained(staging / "scheduler")
        index = {**index, "transformer": ["diffusers", type(model).__name__],
                 "scheduler": ["diffusers", SCHEDULER_CLASS]}
        (staging / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        (staging / "README.md").write_text(readme(adapter_config(model) if adapted else None))
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def check_card(card: dict[str, Any]) -> None:
    unknown = sorted(set(card) - set(CARD_KEYS))
    if unknown:
        raise ValueError(f"export card: unknown key(s) {unknown}; the card takes {list(CARD_KEYS)}")


def _yaml_str(value: Any) -> str:
    return json.dumps(str(value))  # a JSON string is a valid YAML scalar, quotes and all


def markdown_table(rows: dict[str, Any], header: tuple[str, str]) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    lines += [f"| {key} | {value:.4g} |" if isinstance(value, float) else f"| {key} | {value} |"
              for key, value in rows.items()]
    return "\n".join(lines)


def model_card(text: CardText, teacher_dir: Path, num_steps: int, shift: float, scheduler_note: str,
               card: dict[str, Any], lora: Any = None) -> str:
    """README.md of an export: YAML front matter for the hub, then teacher, usage, recipe and scores.

    card: `base_model` (the teacher's hub id; default: its directory name), `license` (optional),
    `recipe` (a string, or a dict of options shown as a table), `metrics` (name -> value).
    """
    base_model = card.get("base_model", teacher_dir.name)
    front = ["---", "library_name: diffusers", f"base_model: {_yaml_str(base_model)}", "base_model_relation: finetune",
             "pipeline_tag: text-to-image"]
    front += [f"license: {_yaml_str(card['license'])}"] if "license" in card else []
    front += ["tags:"] + [f"- {tag}" for tag in ("text-to-image", *text.tags, "diffusers", "dmd2",
                                                  "distillation", f"{num_steps}-step")] + ["---"]
    grid = ", ".join(f"{s:.4f}" for s in student_sigmas(num_steps, shift).tolist())
    recipe = card.get("recipe", "not recorded")
    body = [
        f"# {base_model}, distilled to {num_steps} step{'s' if num_steps > 1 else ''} with DMD2", "",
        f"A few-step student of the {text.title} teacher `{base_model}`, trained with distribution "
        f"matching distillation (DMD2, Yin et al. 2024) and backward simulation. {text.parts}", "",
        "## Usage", "",
        "```python", "import torch", f"from diffusers import {text.pipeline}", "",
        f'pipe = {text.pipeline}.from_pretrained("<this directory>")',
        "torch.manual_seed(0)  # the scheduler's re-noising draws from torch's global generator",
        f'image = pipe(prompt="a photo of a cat", num_inference_steps={num_steps}, {text.call}).images[0]',
        "```", "",
        f"Sample with `num_inference_steps={num_steps}` and {text.guidance}. "
        f"Each step predicts x0 and re-noises it to the next sigma of the student's grid [{grid}] (shift {shift}); "
        f"{scheduler_note}", "",
        "## Recipe", "",
        markdown_table(recipe, ("option", "value")) if isinstance(recipe, dict) else str(recipe), "",
    ]
    if lora is not None:
        body += lora_usage(text, lora, num_steps)
    if card.get("metrics"):
        body += ["## Evaluation", "", markdown_table(card["metrics"], ("metric", "value")), ""]
    return "\n".join(front + body)


def lora_usage(text: CardText, lora: Any, num_steps: int) -> list[str]:
    """The card's section on the adapter alone (`lora`: its peft LoraConfig)."""
    return [
        "## LoRA adapter", "",
        (f"The transformer was trained as LoRA adapters (rank {lora.r}, alpha {lora.lora_alpha}, on "
         f"{', '.join(sorted(lora.target_modules))}); `transformer/` has them merged. The adapter alone is in "
         f"`{LORA_DIR}/`, for the pipeline the student started from, with this directory's scheduler:"), "",
        "```python", f"from diffusers import FlowMatchEulerDiscreteScheduler, {text.pipeline}", "",
        f'pipe = {text.pipeline}.from_pretrained("<the teacher>")',
        f'pipe.load_lora_weights("<this directory>/{LORA_DIR}")',
        'pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained("<this directory>", subfolder="scheduler")',
        f'image = pipe(prompt="a photo of a cat", num_inference_steps={num_steps}, {text.call}).images[0]',
        "```", ""]


def check_sigmas_grid(scheduler: Any, num_steps: int, shift: float) -> None:
    """Refuse a scheduler that does not map the pipeline's `sigmas = linspace(1, 1/N, N)` onto the student's grid
    (FluxPipeline's and QwenImagePipeline's call), e.g. a diffusers release that changed `set_timesteps`."""
    import numpy as np
    import torch

    from dmd2.flow_scheduler import GRID_TOLERANCE

    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=0.0)
    expected = torch.cat([student_sigmas(num_steps, shift), torch.zeros(1)])
    got = scheduler.sigmas.to(torch.float32)
    if got.shape != expected.shape or (got - expected).abs().max() > GRID_TOLERANCE:
        raise RuntimeError(f"the exported scheduler's {num_steps}-step sigmas {got.tolist()} differ from the "
                           f"student's {expected.tolist()}; this diffusers version shifts given sigmas differently: "
                           "update PipelineFamily.export_scheduler (dmd2/flow_pipeline/family.py)")


def export_student(family: Any, student: nn.Module, config: Any, out_dir: Path, card: dict[str, Any]) -> Path:
    """The student of a pipeline family (dmd2/flow_pipeline/family.py) as a complete pipeline directory whose
    scheduler (`family.export_scheduler`) samples as the student at its step count."""
    from dmd2.flow_pipeline.files import check_pipeline

    teacher_dir, num_steps, shift = Path(config.model.teacher), config.student.num_steps, config.student.grid_shift
    check_card(card)
    index = family.export_index(check_pipeline(teacher_dir, family.pipeline_classes, family.name))
    scheduler = family.export_scheduler(config)
    check_sigmas_grid(scheduler, num_steps, shift)
    note = (f"the scheduler (`stochastic_sampling`, a fixed `shift` {shift:.6g} of the pipeline's sigmas "
            f"linspace(1, 1/{num_steps}, {num_steps})) gives exactly that grid at {num_steps} steps, at any "
            "resolution.")
    text = family.card_text(config)
    return export_pipeline(teacher_dir, index, student, scheduler, out_dir,
                           lambda lora: model_card(text, teacher_dir, num_steps, shift, note, card, lora))
