"""Export a distilled Wan student as a complete diffusers `WanPipeline` directory.

The teacher's UMT5, tokenizer and VAE are copied file by file; the student's transformer replaces the teacher's
(both experts for Wan 2.2 A14B, with the teacher's `boundary_ratio`, or the one expert `[student] expert` chose, with
no boundary: it answers every step); the scheduler is a
FlowMatchEulerDiscreteScheduler solved so that the stock pipeline,

    WanPipeline.from_pretrained(out_dir)(prompt, num_inference_steps=N, guidance_scale=1.0),

samples exactly as the project's student sampler (predict x0 at each sigma of `student_sigmas(N, shift)`, re-noise
it to the next with fresh noise; the last x0 is the sample): dmd2/flow_scheduler.py's (its docstring derives the
solve), which WanPipeline steps as StableDiffusion3Pipeline does.
"""

import json
import os
import shutil
from pathlib import Path
from typing import Any

from torch import nn

from dmd2.families.wan.experts import WanExperts
from dmd2.families.wan.pipeline import check_wan_pipeline
from dmd2.flow_scheduler import check_student_grid, student_scheduler_config
from dmd2.lora import adapter_config, adapter_state, has_adapters, merged_copy
from dmd2.pipeline_files import CHECKPOINT_SUFFIXES
from dmd2.schedule import student_sigmas

SCHEDULER_CLASS = "FlowMatchEulerDiscreteScheduler"
REPLACED = ("transformer", "transformer_2", "scheduler")
LORA_DIR = "lora"


def _copy_teacher_parts(teacher_dir: Path, staging: Path, index: dict[str, Any]) -> None:
    """Every present component but the transformers and the scheduler, and the top-level side files."""
    for name, entry in index.items():
        if name.startswith("_") or name in REPLACED or not (isinstance(entry, list) and entry[0]):
            continue
        if not (teacher_dir / name).is_dir():
            raise ValueError(f"[model] teacher {teacher_dir}: model_index.json lists {name} but {teacher_dir / name} "
                             "is missing; complete the download of the pipeline")
        shutil.copytree(teacher_dir / name, staging / name)
    for file in teacher_dir.iterdir():
        if file.is_file() and file.name not in ("model_index.json", "README.md") \
                and not file.name.endswith(CHECKPOINT_SUFFIXES):
            shutil.copy2(file, staging / file.name)


def _save_transformers(model: nn.Module, staging: Path) -> dict[str, list[str]]:
    """The student's transformer(s), LoRA merged (the adapters alone in `lora/`); returns their index entries."""
    experts = {"transformer": model.transformer, "transformer_2": model.transformer_2} \
        if isinstance(model, WanExperts) else {"transformer": model}
    entries = {}
    for name, expert in experts.items():
        adapted = has_adapters(expert)
        (merged_copy(expert) if adapted else expert).save_pretrained(staging / name, safe_serialization=True)
        entries[name] = ["diffusers", type(expert).__name__]
        if adapted:
            from diffusers import WanPipeline  # slow to import; only exports need it

            # diffusers' Wan LoRA layout: `transformer.` keys, loaded by WanPipeline.load_lora_weights
            WanPipeline.save_lora_weights(staging / LORA_DIR / name, transformer_lora_layers=adapter_state(expert),
                                          transformer_lora_adapter_metadata=adapter_config(expert).to_dict())
    return entries


def export_pipeline(teacher_dir: str | Path, transformer: nn.Module, num_steps: int, shift: float,
                    out_dir: str | Path, card: dict[str, Any]) -> Path:
    """Write the student's WanPipeline into `out_dir` (which must not exist yet), built in a hidden sibling and
    renamed into place, so `out_dir` is either absent or complete. `card`: recipe, metrics."""
    from diffusers import FlowMatchEulerDiscreteScheduler  # slow to import; only exports need it

    teacher_dir, out_dir = Path(teacher_dir), Path(out_dir)
    index = check_wan_pipeline(teacher_dir)
    if out_dir.exists():
        raise FileExistsError(f"export: {out_dir} already exists; remove it or export to a new directory")
    staging = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)  # what a crashed earlier export left
    try:
        staging.mkdir(parents=True)
        _copy_teacher_parts(teacher_dir, staging, index)
        entries = _save_transformers(getattr(transformer, "module", transformer), staging)
        if "transformer_2" not in entries and index.get("boundary_ratio") is not None:
            # One expert of a Wan 2.2 teacher (`[student] expert`): the pipeline calls it at every step.
            entries |= {"transformer_2": [None, None], "boundary_ratio": None}
        scheduler = FlowMatchEulerDiscreteScheduler(**student_scheduler_config(num_steps, shift))
        check_student_grid(scheduler, num_steps, shift)
        scheduler.save_pretrained(staging / "scheduler")
        index = {**index, **entries, "scheduler": ["diffusers", SCHEDULER_CLASS]}
        (staging / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        adapters = sorted(path.name for path in (staging / LORA_DIR).iterdir()) if (staging / LORA_DIR).is_dir() else []
        (staging / "README.md").write_text(model_card(teacher_dir, num_steps, shift, card) + _lora_usage(adapters))
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def markdown_table(rows: dict[str, Any], header: tuple[str, str]) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    return "\n".join(lines + [f"| {key} | {value:.4g} |" if isinstance(value, float) else f"| {key} | {value} |"
                              for key, value in rows.items()])


def model_card(teacher_dir: Path, num_steps: int, shift: float, card: dict[str, Any]) -> str:
    """README.md of an export: hub front matter, usage, the student's grid, the recipe and the scores."""
    base_model = card.get("base_model", teacher_dir.name)
    grid = ", ".join(f"{s:.4f}" for s in student_sigmas(num_steps, shift).tolist())
    tags = ("text-to-video", "wan", "diffusers", "dmd2", "distillation", f"{num_steps}-step")
    recipe = card.get("recipe", "not recorded")
    lines = ["---", "library_name: diffusers", f"base_model: {json.dumps(str(base_model))}",
             "base_model_relation: finetune", "pipeline_tag: text-to-video", "tags:", *(f"- {t}" for t in tags), "---",
             f"# {base_model}, distilled to {num_steps} step{'s' if num_steps > 1 else ''} with DMD2", "",
             f"A few-step student of the Wan teacher `{base_model}`, trained with distribution matching distillation "
             "(DMD2, Yin et al. 2024) and backward simulation. UMT5, tokenizer and VAE are the teacher's; only the "
             "transformer was trained.", "", "## Usage", "",
             "```python", "import torch", "from diffusers import WanPipeline", "from diffusers.utils import "
             "export_to_video", "", 'pipe = WanPipeline.from_pretrained("<this directory>")',
             "torch.manual_seed(0)  # the scheduler's re-noising draws from torch's global generator",
             f'video = pipe("a cat runs on the grass", num_inference_steps={num_steps}, guidance_scale=1.0).frames[0]',
             'export_to_video(video, "cat.mp4", fps=16)', "```", "",
             f"Sample with `num_inference_steps={num_steps}` and `guidance_scale=1.0` (the student is unguided). Each "
             f"step predicts x0 and re-noises it to the next sigma of the student's grid [{grid}] (the teacher's "
             f"flow shift {shift}); the scheduler is set to give exactly that grid at {num_steps} steps. The model's "
             f"time shift is {shift} (`flow_shift` of the teacher's UniPC scheduler).", "",
             "## Recipe", "", markdown_table(recipe, ("option", "value")) if isinstance(recipe, dict) else str(recipe),
             ""]
    if card.get("metrics"):
        lines += ["## Evaluation", "", markdown_table(card["metrics"], ("metric", "value")), ""]
    return "\n".join(lines)


def _lora_usage(adapters: list[str]) -> str:
    """The card's section on the LoRA adapters alone (`lora/<transformer>`), when the student was LoRA."""
    if not adapters:
        return ""
    loads = [f'pipe.load_lora_weights("<this directory>/{LORA_DIR}/{name}"'
             + (", load_into_transformer_2=True)" if name == "transformer_2" else ")") for name in adapters]
    text = (f"The transformer was trained as LoRA adapters; `{'/`, `'.join(adapters)}/` hold them merged. The "
            f"adapters alone are in `{LORA_DIR}/`, for the teacher pipeline, with this directory's scheduler:")
    return "\n".join(["## LoRA adapters", "", text, "", "```python",
                      "from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline", "",
                      'pipe = WanPipeline.from_pretrained("<the teacher>")', *loads,
                      'pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained("<this directory>", '
                      'subfolder="scheduler")', "```", ""])
