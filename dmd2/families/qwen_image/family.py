"""The qwen_image family: a diffusers `QwenImagePipeline` teacher (Qwen-Image), its transformer distilled into a
few-step student, on the pipeline families' base (dmd2/flow_pipeline/family.py).

What Qwen-Image states: the teacher's time shift at the run's resolution is the pipeline's own dynamic shift, e^mu
of the packed image's token count (dmd2/families/qwen_image/pipeline.py); prompts are encoded by its Qwen2.5-VL
(`encode_prompt`) into a padded table with masks (`prompts`); the samples are its VAE's latents normalised per
channel, (z - latents_mean) / latents_std, as the pipeline decodes them; the teacher's real score is the pipeline's
true CFG over `[data] negative_prompt` at `[dmd2] teacher_guidance_scale`, with its norm rescaling (`velocity`). The
student is unguided: its export is called with `true_cfg_scale=1.0` and no negative prompt.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dmd2.config import DistillConfig
from dmd2.families.qwen_image import pipeline
from dmd2.families.qwen_image.prompts import QwenPromptTable, encode_prompt_table, merge_parts
from dmd2.flow_pipeline.export import CardText
from dmd2.flow_pipeline.family import PipelineFamily
from dmd2.model import VelocityFn


@dataclass(frozen=True)
class QwenImageFamily(PipelineFamily):
    name = "qwen_image"
    pipeline_classes = pipeline.PIPELINE_CLASSES
    transformer_class = "QwenImageTransformer2DModel"
    card = CardText(title="Qwen-Image", pipeline="QwenImagePipeline", tags=("qwen-image",),
                    parts="The Qwen2.5-VL text encoder, its tokenizer and the VAE are the teacher's; only the "
                          "transformer was trained.",
                    call="true_cfg_scale=1.0", guidance="`true_cfg_scale=1.0` and no negative prompt (the student "
                                                        "is unguided)")
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")  # the image stream's attention (diffusers' LoRA loaders')
    table: QwenPromptTable | None = None

    def teacher_shift(self, teacher: str, resolution: int) -> float:
        return pipeline.teacher_shift(teacher, resolution)

    def sample_shape(self, teacher: str, config: DistillConfig) -> tuple[int, ...]:
        return pipeline.latent_shape(teacher, config.data.resolution or pipeline.default_resolution(teacher))

    def default_resolution(self, teacher: str) -> int:
        return pipeline.default_resolution(teacher)

    def check_sequence_split(self, teacher: str, config: DistillConfig) -> None:
        pipeline.check_sequence_split(teacher, config.data.resolution or pipeline.default_resolution(teacher),
                                      config.train.sequence_parallel)

    def encode_prompts(self, pipe: Any, prompts: list[str], negative_prompt: str,
                       max_sequence_length: int) -> dict[str, Tensor]:
        return encode_prompt_table(pipe, prompts, negative_prompt, max_sequence_length)

    def merge_prepared(self, parts: list[dict[str, dict[str, Tensor]]]) -> dict[str, dict[str, Tensor]]:
        """The parts' tables, each cut to its own longest row, padded to the longest of them all and concatenated."""
        return {"prompts": merge_parts([part.get("prompts", {}) for part in parts])}

    def table_from(self, tensors: dict[str, Tensor]) -> QwenPromptTable:
        return QwenPromptTable.from_tensors(tensors)

    def velocity(self, model: nn.Module) -> VelocityFn:
        from dmd2.families.qwen_image.velocity import QwenImageVelocity

        if self.table is None:
            raise RuntimeError("the qwen_image family calls models through its prompt table: bind the prepared "
                               "inputs first")
        return QwenImageVelocity(model, self.table)

    def load_vae(self, teacher: str) -> nn.Module:
        from diffusers import AutoencoderKLQwenImage

        return AutoencoderKLQwenImage.from_pretrained(teacher, subfolder="vae", use_safetensors=True)

    def decode_latents(self, vae: nn.Module, latents: Tensor) -> Tensor:
        """Normalised latents [N, C, h, w] -> pictures [N, 3, H, W], as QwenImagePipeline decodes them: z = latents *
        latents_std + latents_mean per channel, one frame of the video VAE."""
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        return vae.decode(latents[:, :, None] * std + mean, return_dict=False)[0][:, :, 0]

    def pipeline_call(self, settings: dict[str, Any]) -> dict[str, Any]:
        call = super().pipeline_call(settings)
        del call["guidance_scale"]  # Qwen-Image has no guidance input: true CFG, off at 1
        return call | {"true_cfg_scale": 1.0}

    # -- dmd2 plan: Qwen-Image by hub id (nothing downloaded), a pipeline directory by its configs --

    def model_on_meta(self, path: str, dtype: torch.dtype | None = None) -> nn.Module:
        from diffusers import QwenImageTransformer2DModel

        from dmd2.families.qwen_image.published import PUBLISHED
        from dmd2.model import architecture, on_meta

        model = on_meta(QwenImageTransformer2DModel, PUBLISHED[path][0], dtype) if path in PUBLISHED \
            else architecture(path, dtype, subfolder="transformer")
        # Its RoPE tables are plain tensors, not buffers (complex numbers): built on the meta device they would stay
        # there, since neither `to_empty` nor a state dict restores them, so they are made again on the host.
        rope = model.pos_embed
        with torch.device("cpu"):
            model.pos_embed = type(rope)(theta=rope.theta, axes_dim=rope.axes_dim, scale_rope=rope.scale_rope)
        return model

    def plan_bind(self, config: DistillConfig, device: torch.device | str) -> "QwenImageFamily":
        """A table of one zero prompt of `[data] max_sequence_length` tokens of the text width, in host memory."""
        width = pipeline._configs(config.model.teacher)[0]["joint_attention_dim"]
        tokens = config.data.max_sequence_length
        embeds, mask = torch.zeros(1, tokens, width), torch.ones(1, tokens, dtype=torch.long)
        return dataclasses.replace(self, table=QwenPromptTable(embeds, mask, embeds.clone(), mask.clone()))
