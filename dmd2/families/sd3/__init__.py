"""Stable Diffusion 3 / 3.5: a diffusers `StableDiffusion3Pipeline` teacher distilled into a few-step MMDiT.

Building blocks, in the order a run uses them: check the teacher directory (`pipeline`), read and
encode the prompts once (`prompts`), condition by prompt index (`conditioning`), export the student
as a pipeline that the stock diffusers sampler runs exactly as the student's sampler (`export`).
Importing this package is cheap: diffusers and transformers load only where models do.
"""

from dmd2.families.sd3.conditioning import NEGATIVE, PromptTable, TableVelocity, negative_indices, prompt_indices
from dmd2.families.sd3.export import export_pipeline, model_card, student_scheduler_config
from dmd2.families.sd3.pipeline import (
    check_flow_matching,
    check_sd3_pipeline,
    is_sd3_pipeline,
    latent_shape,
    load_transformer,
    read_pipeline_index,
    shift_of,
)
from dmd2.families.sd3.prompts import (
    encode_prompt_table,
    encoder_fingerprint,
    load_text_pipeline,
    prompts_digest,
    read_prompts,
)

__all__ = [
    "NEGATIVE",
    "PromptTable",
    "TableVelocity",
    "check_flow_matching",
    "check_sd3_pipeline",
    "encode_prompt_table",
    "encoder_fingerprint",
    "export_pipeline",
    "is_sd3_pipeline",
    "latent_shape",
    "load_text_pipeline",
    "load_transformer",
    "model_card",
    "negative_indices",
    "prompt_indices",
    "prompts_digest",
    "read_pipeline_index",
    "read_prompts",
    "shift_of",
    "student_scheduler_config",
]
