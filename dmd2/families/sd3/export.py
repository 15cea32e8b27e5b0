"""Export a distilled SD3 student as a complete diffusers `StableDiffusion3Pipeline` directory.

The teacher's text encoders, tokenizers and VAE are copied file by file; the student's transformer
replaces the teacher's; the scheduler is set so that the stock pipeline,

    StableDiffusion3Pipeline.from_pretrained(out_dir)(prompt, num_inference_steps=N, guidance_scale=1.0),

samples exactly as the project's student sampler (dmd2/rollout.py `backward_simulate` run to the end):
at each sigma_j of `student_sigmas(N, shift)` predict x0 = x_s - sigma_j v, then re-noise it to
sigma_{j+1} with fresh noise; the last step's x0 is the sample.
"""

import json
import os
import shutil
from pathlib import Path
from typing import Any

from torch import nn

from dmd2.families.sd3.pipeline import SCHEDULER_CLASS, check_flow_matching, check_sd3_pipeline
from dmd2.flow_scheduler import GRID_TOLERANCE, check_student_grid, student_scheduler_config  # noqa: F401 (re-exported)
from dmd2.lora import adapter_config, adapter_state, has_adapters, merged_copy
from dmd2.pipeline_files import CHECKPOINT_SUFFIXES
from dmd2.schedule import student_sigmas

CARD_KEYS = ("base_model", "license", "recipe", "metrics")
LORA_DIR = "lora"  # a LoRA student's adapter alone, beside the merged transformer


def _copy_teacher_parts(teacher_dir: Path, staging: Path, index: dict[str, Any]) -> None:
    """Copy every present component but the transformer and scheduler, and the top-level side files
    (licence, notes); skip single-file checkpoints that hub snapshots keep next to the pipeline."""
    for name, entry in index.items():
        if name.startswith("_") or name in ("transformer", "scheduler"):
            continue
        if not (isinstance(entry, list) and entry[0]):
            continue  # a null entry: the pipeline has no such component (e.g. no image encoder)
        if not (teacher_dir / name).is_dir():
            raise ValueError(f"[model] teacher {teacher_dir}: model_index.json lists {name} but {teacher_dir / name} "
                             f"is missing; complete the download of the pipeline")
        shutil.copytree(teacher_dir / name, staging / name)  # symlinks (a hub cache) are copied as files
    for file in teacher_dir.iterdir():
        if file.is_file() and file.name not in ("model_index.json", "README.md") \
                and not file.name.endswith(CHECKPOINT_SUFFIXES):
            shutil.copy2(file, staging / file.name)


def save_lora(transformer: nn.Module, out_dir: Path) -> None:
    """The transformer's LoRA adapter alone, as diffusers' SD3 LoRA training script saves it (peft-format keys,
    `transformer.` prefix, the LoraConfig as metadata): `StableDiffusion3Pipeline.load_lora_weights(out_dir)`
    loads it onto the pipeline the student started from."""
    from diffusers import StableDiffusion3Pipeline  # slow to import; only exports need it

    StableDiffusion3Pipeline.save_lora_weights(out_dir, transformer_lora_layers=adapter_state(transformer),
                                               transformer_lora_adapter_metadata=adapter_config(transformer).to_dict())


def _write_pipeline(teacher_dir: Path, transformer: nn.Module, num_steps: int, shift: float, staging: Path,
                    card: dict[str, Any]) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler  # slow to import; only exports need it

    index = check_sd3_pipeline(teacher_dir)
    staging.mkdir(parents=True)
    _copy_teacher_parts(teacher_dir, staging, index)
    model = getattr(transformer, "module", transformer)  # DDP and FSDP wrappers keep the model in .module
    adapted = has_adapters(model)
    (merged_copy(model) if adapted else model).save_pretrained(staging / "transformer", safe_serialization=True)
    if adapted:
        save_lora(model, staging / LORA_DIR)
    scheduler = FlowMatchEulerDiscreteScheduler(**student_scheduler_config(num_steps, shift))
    check_student_grid(scheduler, num_steps, shift)
    scheduler.save_pretrained(staging / "scheduler")
    index = {**index, "transformer": ["diffusers", type(model).__name__], "scheduler": ["diffusers", SCHEDULER_CLASS]}
    (staging / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    lora = adapter_config(model) if adapted else None
    (staging / "README.md").write_text(model_card(teacher_dir, num_steps, shift, scheduler.config, card, lora))


def export_pipeline(teacher_dir: str | Path, transformer: nn.Module, num_steps: int, shift: float,
                    out_dir: str | Path, card: dict[str, Any]) -> Path:
    """Write the student's StableDiffusion3Pipeline into `out_dir` (which must not exist yet); return it.

    The directory is built in a hidden sibling (`.<name>.partial`) and renamed into place at the end,
    so `out_dir` is either absent or complete, whatever happens meanwhile. `card`: see `model_card`.
    """
    teacher_dir, out_dir = Path(teacher_dir), Path(out_dir)
    check_flow_matching(teacher_dir)
    unknown = sorted(set(card) - set(CARD_KEYS))
    if unknown:
        raise ValueError(f"export card: unknown key(s) {unknown}; the card takes {list(CARD_KEYS)}")
    if out_dir.exists():
        raise FileExistsError(f"export: {out_dir} already exists; remove it or export to a new directory")
    staging = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)  # what a crashed earlier export left
    try:
        _write_pipeline(teacher_dir, transformer, num_steps, shift, staging, card)
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _yaml_str(value: Any) -> str:
    return json.dumps(str(value))  # a JSON string is a valid YAML scalar, quotes and all


def markdown_table(rows: dict[str, Any], header: tuple[str, str]) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    lines += [f"| {key} | {value:.4g} |" if isinstance(value, float) else f"| {key} | {value} |"
              for key, value in rows.items()]
    return "\n".join(lines)


def model_card(teacher_dir: Path, num_steps: int, shift: float, scheduler_config: dict[str, Any],
               card: dict[str, Any], lora: Any = None) -> str:
    """README.md of an export: YAML front matter for the hub, then teacher, recipe, steps and scores.

    card: `base_model` (the teacher's hub id; default: its directory name), `license` (optional),
    `recipe` (a string, or a dict of options shown as a table), `metrics` (name -> value).
    """
    base_model = card.get("base_model", teacher_dir.name)
    front = ["---", "library_name: diffusers", f"base_model: {_yaml_str(base_model)}", "base_model_relation: finetune",
             "pipeline_tag: text-to-image"]
    front += [f"license: {_yaml_str(card['license'])}"] if "license" in card else []
    front += ["tags:"] + [f"- {tag}" for tag in ("text-to-image", "stable-diffusion-3", "diffusers", "dmd2",
                                                  "distillation", f"{num_steps}-step")] + ["---"]
    grid = ", ".join(f"{s:.4f}" for s in student_sigmas(num_steps, shift).tolist())
    recipe = card.get("recipe", "not recorded")
    body = [
        f"# {base_model}, distilled to {num_steps} step{'s' if num_steps > 1 else ''} with DMD2", "",
        f"A few-step student of the Stable Diffusion 3 teacher `{base_model}`, trained with distribution "
        "matching distillation (DMD2, Yin et al. 2024) and backward simulation. Text encoders, tokenizers "
        "and VAE are the teacher's; only the transformer was trained.", "",
        "## Usage", "",
        "```python", "import torch", "from diffusers import StableDiffusion3Pipeline", "",
        'pipe = StableDiffusion3Pipeline.from_pretrained("<this directory>")',
        "torch.manual_seed(0)  # the scheduler's re-noising draws from torch's global generator",
        f'image = pipe("a photo of a cat", num_inference_steps={num_steps}, guidance_scale=1.0).images[0]',
        "```", "",
        f"Sample with `num_inference_steps={num_steps}` and `guidance_scale=1.0` (the student is unguided). "
        f"Each step predicts x0 and re-noises it to the next sigma of the student's grid [{grid}] (shift {shift}); "
        f"the scheduler (`stochastic_sampling`, `shift` {scheduler_config['shift']:.6g}, `shift_terminal` "
        f"{scheduler_config['shift_terminal']}) is set to give exactly that grid at {num_steps} steps.", "",
        "## Recipe", "",
        markdown_table(recipe, ("option", "value")) if isinstance(recipe, dict) else str(recipe), "",
    ]
    if lora is not None:
        body += _lora_usage(lora, num_steps)
    if card.get("metrics"):
        body += ["## Evaluation", "", markdown_table(card["metrics"], ("metric", "value")), ""]
    return "\n".join(front + body)


def _lora_usage(lora: Any, num_steps: int) -> list[str]:
    """The card's section on the adapter alone (`lora`: its peft LoraConfig)."""
    return [
        "## LoRA adapter", "",
        (f"The transformer was trained as LoRA adapters (rank {lora.r}, alpha {lora.lora_alpha}, on "
         f"{', '.join(sorted(lora.target_modules))}); `transformer/` has them merged. The adapter alone is in "
         f"`{LORA_DIR}/`, for the pipeline the student started from, with this directory's scheduler:"), "",
        "```python", "from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline", "",
        'pipe = StableDiffusion3Pipeline.from_pretrained("<the teacher>")',
        f'pipe.load_lora_weights("<this directory>/{LORA_DIR}")',
        'pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained("<this directory>", subfolder="scheduler")',
        f'image = pipe("a photo of a cat", num_inference_steps={num_steps}, guidance_scale=1.0).images[0]',
        "```", ""]
