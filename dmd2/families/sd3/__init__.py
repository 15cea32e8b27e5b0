"""Stable Diffusion 3 / 3.5: a diffusers `StableDiffusion3Pipeline` teacher distilled into a few-step MMDiT.

Building blocks, in the order a run uses them: check the teacher directory (`pipeline`), read and
encode the prompts once (`prompt_file`, `prompts`) and the GAN's real images (`image_folder`,
`real_images`), condition by prompt index (`conditioning`), export the student as a pipeline that the
stock diffusers sampler runs exactly as the student's sampler (`export`). Importing this package is cheap: the names below load on first use (`dmd2.lazy`), torch
with the modules that need it, diffusers and transformers only where models do.
"""

from dmd2.lazy import lazy_exports

__all__ = [
    "NEGATIVE",
    "PromptTable",
    "RealImage",
    "TableVelocity",
    "caption_rows",
    "check_flow_matching",
    "check_sd3_pipeline",
    "components_fingerprint",
    "encode_images",
    "encode_prompt_table",
    "encoder_fingerprint",
    "export_pipeline",
    "images_digest",
    "is_sd3_pipeline",
    "latent_shape",
    "load_text_pipeline",
    "load_transformer",
    "model_card",
    "negative_indices",
    "prompt_indices",
    "prompts_digest",
    "read_image_folder",
    "read_pipeline_index",
    "read_prompts",
    "shift_of",
    "student_scheduler_config",
]
__getattr__, __dir__ = lazy_exports(__name__, {
    "conditioning": ["NEGATIVE", "PromptTable", "TableVelocity", "negative_indices", "prompt_indices"],
    "export": ["export_pipeline", "model_card", "student_scheduler_config"],
    "image_folder": ["RealImage", "read_image_folder"],
    "pipeline": ["check_flow_matching", "check_sd3_pipeline", "is_sd3_pipeline", "latent_shape", "load_transformer",
                 "read_pipeline_index", "shift_of"],
    "prompt_file": ["read_prompts"],
    "prompts": ["components_fingerprint", "encode_prompt_table", "encoder_fingerprint", "load_text_pipeline",
                "prompts_digest"],
    "real_images": ["caption_rows", "encode_images", "images_digest"],
})
