"""Export a distilled SD3 student as a complete diffusers `StableDiffusion3Pipeline` directory (dmd2/flow_pipeline/
export.py: the teacher's parts copied, the student's transformer, its LoRA adapter alone), whose scheduler is set so
that the stock pipeline,

    StableDiffusion3Pipeline.from_pretrained(out_dir)(prompt, num_inference_steps=N, guidance_scale=1.0),

samples exactly as the project's student sampler: StableDiffusion3Pipeline calls `set_timesteps(N)`, whose grid
dmd2/flow_scheduler.py solves for the student's.
"""

from pathlib import Path
from typing import Any

from torch import nn

from dmd2.families.sd3.pipeline import check_flow_matching, check_sd3_pipeline
from dmd2.flow_pipeline import export as base
from dmd2.flow_pipeline.export import CARD_KEYS, LORA_DIR, CardText, markdown_table  # noqa: F401 (re-exported)
from dmd2.flow_scheduler import GRID_TOLERANCE, check_student_grid, student_scheduler_config  # noqa: F401 (re-exported)

CARD = CardText(title="Stable Diffusion 3", pipeline="StableDiffusion3Pipeline", tags=("stable-diffusion-3",),
                parts="Text encoders, tokenizers and VAE are the teacher's; only the transformer was trained.",
                call="guidance_scale=1.0", guidance="`guidance_scale=1.0` (the student is unguided)")

def export_pipeline(teacher_dir: str | Path, transformer: nn.Module, num_steps: int, shift: float,
                    out_dir: str | Path, card: dict[str, Any]) -> Path:
    """Write the student's StableDiffusion3Pipeline into `out_dir` (which must not exist yet); return it.
    `card`: see `model_card`."""
    from diffusers import FlowMatchEulerDiscreteScheduler  # slow to import; only exports need it

    teacher_dir, out_dir = Path(teacher_dir), Path(out_dir)
    check_flow_matching(teacher_dir)
    base.check_card(card)
    if out_dir.exists():
        raise FileExistsError(f"export: {out_dir} already exists; remove it or export to a new directory")
    scheduler = FlowMatchEulerDiscreteScheduler(**student_scheduler_config(num_steps, shift))
    check_student_grid(scheduler, num_steps, shift)
    return base.export_pipeline(teacher_dir, check_sd3_pipeline(teacher_dir), transformer, scheduler, out_dir,
                                lambda lora: model_card(teacher_dir, num_steps, shift, scheduler.config, card, lora))

def model_card(teacher_dir: Path, num_steps: int, shift: float, scheduler_config: dict[str, Any],
               card: dict[str, Any], lora: Any = None) -> str:
    """README.md of an export (dmd2/flow_pipeline/export.py `model_card`), naming the solved scheduler."""
    note = (f"the scheduler (`stochastic_sampling`, `shift` {scheduler_config['shift']:.6g}, `shift_terminal` "
            f"{scheduler_config['shift_terminal']}) is set to give exactly that grid at {num_steps} steps.")
    return base.model_card(CARD, teacher_dir, num_steps, shift, note, card, lora)
