"""The flux2_klein family: a diffusers `Flux2KleinPipeline` teacher (FLUX.2 [klein], its base or its step-distilled
model), its transformer distilled into a few-step student, on the pipeline families' base
(dmd2/flow_pipeline/family.py).

What klein states: the samples are the pipeline's latent space, patchified and batch-norm normalised
(dmd2/families/flux/klein/pipeline.py), decoded as the pipeline decodes them; the run's shift is the pipeline's own
at the run's resolution and the student's step count (its empirical `mu`), so the student's grid is the stock
pipeline's at that many steps; prompts are encoded by its Qwen3 (`prompts`); the transformer is called as the
pipeline calls it (`velocity`). The teacher's real score is the pipeline's CFG over `[data] negative_prompt` at
`[dmd2] teacher_guidance_scale` (its `guidance_scale`: the base model's default is 4.0); a step-distilled teacher
ignores guidance, so a scale > 1 is refused for it. The student is unguided and step-distilled: its export says so
(`is_distilled`), so the stock pipeline ignores guidance_scale for it as for BFL's own 4-step klein.
"""

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dmd2.config import ConfigError, DistillConfig
from dmd2.families.flux.family import FluxFamily
from dmd2.families.flux.klein import pipeline
from dmd2.families.flux.klein.prompts import encode_prompt_table
from dmd2.flow_pipeline.export import CardText
from dmd2.flow_pipeline.family import PipelineFamily
from dmd2.flow_pipeline.packing import unpack
from dmd2.flow_pipeline.prompts import StatesTable
from dmd2.model import VelocityFn


@dataclass(frozen=True)
class Flux2KleinFamily(PipelineFamily):
    name = pipeline.FAMILY
    pipeline_classes = pipeline.PIPELINE_CLASSES
    transformer_class = "Flux2Transformer2DModel"
    card = CardText(title="FLUX.2 [klein]", pipeline="Flux2KleinPipeline", tags=("flux2", "flux2-klein"),
                    parts="The Qwen3 text encoder, its tokenizer and the VAE are the teacher's; only the transformer "
                          "was trained.",
                    call="guidance_scale=1.0", guidance="no guidance (the student is unguided; its model_index.json "
                                                        "sets `is_distilled`, so the pipeline ignores guidance_scale)")
    # FLUX.1's attention layers (the double blocks') and the single blocks' fused input projection, as diffusers
    # converts BFL's klein LoRAs (`linear1` -> `to_qkv_mlp_proj`): the single blocks are most of klein's depth.
    lora_targets = FluxFamily.lora_targets + ("to_qkv_mlp_proj",)
    table: StatesTable | None = None

    def run_shift(self, teacher: str, config: DistillConfig) -> float:
        return pipeline.teacher_shift(teacher, config.data.resolution, config.student.num_steps)

    def sample_shape(self, teacher: str, config: DistillConfig) -> tuple[int, ...]:
        return pipeline.latent_shape(teacher, config.data.resolution or pipeline.default_resolution(teacher))

    def default_resolution(self, teacher: str) -> int:
        return pipeline.default_resolution(teacher)

    def resolve(self, config: DistillConfig, cache_dir: Path) -> DistillConfig:
        config = super().resolve(config, cache_dir)
        try:
            pipeline.check_guidance(config.model.teacher, config)  # a hub id's model_index.json is read only now
        except ValueError as error:
            raise ConfigError(str(error)) from None
        return config

    def encode_prompts(self, pipe: Any, prompts: list[str], negative_prompt: str,
                       max_sequence_length: int) -> dict[str, Tensor]:
        return encode_prompt_table(pipe, prompts, negative_prompt, max_sequence_length)

    def table_from(self, tensors: dict[str, Tensor]) -> StatesTable:
        return StatesTable.from_tensors(tensors)

    def velocity(self, model: nn.Module) -> VelocityFn:
        from dmd2.families.flux.klein.velocity import KleinVelocity

        if self.table is None:
            raise RuntimeError("the flux2_klein family calls models through its prompt table: bind the prepared "
                               "inputs first")
        return KleinVelocity(model, self.table)

    def load_vae(self, teacher: str) -> nn.Module:
        from diffusers import AutoencoderKLFlux2

        return AutoencoderKLFlux2.from_pretrained(teacher, subfolder="vae", use_safetensors=True)

    def decode_latents(self, vae: nn.Module, latents: Tensor) -> Tensor:
        """Normalised latents [N, 4C, h, w] -> pictures [N, 3, H, W], as Flux2KleinPipeline decodes them: times the
        batch norm's running std, plus its mean, unpatchified to the VAE's cells [N, C, 2h, 2w] (FLUX.1's unpacking
        of the row-major tokens: the same 2 x 2 channel order), decoded."""
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents)
        latents = latents * std + mean
        cells = unpack(latents.flatten(2).transpose(1, 2), 2 * latents.shape[-2], 2 * latents.shape[-1])
        return vae.decode(cells, return_dict=False)[0]

    def export_index(self, index: dict[str, Any]) -> dict[str, Any]:
        return index | {"is_distilled": True}

    # -- dmd2 plan: a pipeline directory (or a hub-cached snapshot) by its configs, no published ones kept --

    def model_on_meta(self, path: str, dtype: torch.dtype | None = None) -> nn.Module:
        from dmd2.model import architecture

        return architecture(pipeline.teacher_dir(path), dtype, subfolder="transformer")

    def plan_bind(self, config: DistillConfig, device: torch.device | str) -> "Flux2KleinFamily":
        """A table of one zero prompt of `[data] max_sequence_length` tokens of the text width, in host memory."""
        width = pipeline.transformer_config(config.model.teacher)["joint_attention_dim"]
        embeds = torch.zeros(1, config.data.max_sequence_length, width)
        return dataclasses.replace(self, table=StatesTable(embeds, embeds.clone()))
