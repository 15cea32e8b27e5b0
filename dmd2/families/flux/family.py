"""The flux family: a diffusers `FluxPipeline` teacher (FLUX.1 [dev]), its transformer distilled into a few-step
student, on the pipeline families' base (dmd2/flow_pipeline/family.py).

What FLUX states: the teacher's time shift at the run's resolution is the pipeline's own dynamic shift, e^mu with
`mu` from the image's token count (dmd2/families/flux/pipeline.py), so the student's grid and the critic's sigmas
follow the resolution as FluxPipeline's do; prompts are encoded by its CLIP and T5 (`encode_prompt`: T5's tokens and
CLIP's pooled vector); the transformer is called as the pipeline calls it (dmd2/families/flux/velocity.py). FLUX.1
[dev] is guidance-distilled: `[dmd2] teacher_guidance_scale` is its guidance input, the teacher's real score has no
negative branch (unless `[dmd2] teacher_true_cfg_scale` > 1 adds FluxPipeline's true CFG on top), and the student
keeps that input at the same value (it starts as the teacher at that guidance; its export is called with
`guidance_scale` = it).
"""

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dmd2.config import DistillConfig
from dmd2.family import RunSpec
from dmd2.families.flux import pipeline
from dmd2.flow_pipeline.export import CardText
from dmd2.flow_pipeline.family import PipelineFamily
from dmd2.flow_pipeline.prompts import PromptTable, encode_rows
from dmd2.model import VelocityFn

DEFAULT_GUIDANCE = 3.5  # FluxPipeline's default guidance_scale, for a run without [dmd2]


def _guidance(config: DistillConfig) -> float:
    return config.dmd2.teacher_guidance_scale if config.dmd2 is not None else DEFAULT_GUIDANCE


def _true_cfg(config: DistillConfig) -> float:
    return config.dmd2.teacher_true_cfg_scale if config.dmd2 is not None else 1.0


@dataclass(frozen=True)
class FluxFamily(PipelineFamily):
    name = "flux"
    pipeline_classes = pipeline.PIPELINE_CLASSES
    transformer_class = "FluxTransformer2DModel"
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")  # the double and single blocks' attention
    table: PromptTable | None = None
    guidance: float = DEFAULT_GUIDANCE  # the guidance input of every model call (run_spec: the recipe's)
    true_cfg: float = 1.0  # the teacher's true CFG on top of its guidance input (run_spec: the recipe's)

    def teacher_shift(self, teacher: str, resolution: int) -> float:
        return pipeline.teacher_shift(teacher, resolution)

    def sample_shape(self, teacher: str, config: DistillConfig) -> tuple[int, ...]:
        return pipeline.latent_shape(teacher, config.data.resolution or pipeline.default_resolution(teacher))

    def default_resolution(self, teacher: str) -> int:
        return pipeline.default_resolution(teacher)

    def check_sequence_split(self, teacher: str, config: DistillConfig) -> None:
        pipeline.check_sequence_split(teacher, config.data.resolution or pipeline.default_resolution(teacher),
                                      config.data.max_sequence_length, config.train.sequence_parallel)

    def run_spec(self, config: DistillConfig, cache_dir: Path) -> RunSpec:
        return dataclasses.replace(super().run_spec(config, cache_dir), family=self.planned(config))

    def encode_prompts(self, pipe: Any, prompts: list[str], negative_prompt: str,
                       max_sequence_length: int) -> dict[str, Tensor]:
        """FluxPipeline.encode_prompt: T5's [P, max_sequence_length, D] and CLIP's pooled [P, Dp] (its `text_ids` are
        zeros, made again per call)."""
        def encode(batch: list[str]) -> tuple[Tensor, Tensor]:
            embeds, pooled, _ = pipe.encode_prompt(batch, prompt_2=None, max_sequence_length=max_sequence_length)
            return embeds.cpu(), pooled.cpu()

        return encode_rows(encode, prompts, negative_prompt, ("prompt_embeds", "pooled_prompt_embeds"))

    def velocity(self, model: nn.Module) -> VelocityFn:
        from dmd2.families.flux.velocity import FluxVelocity

        if self.table is None:
            raise RuntimeError("the flux family calls models through its prompt table: bind the prepared inputs first")
        return FluxVelocity(model, self.table, self.guidance, self.true_cfg)

    def card_text(self, config: DistillConfig) -> CardText:
        guidance = _guidance(config)
        return CardText(title="FLUX.1", pipeline="FluxPipeline", tags=("flux",),
                        parts="Text encoders, tokenizers and VAE are the teacher's; only the transformer was trained.",
                        call=f"guidance_scale={guidance:g}",
                        guidance=f"`guidance_scale={guidance:g}` (the guidance input the student was distilled at; "
                                 "no negative prompt)")

    def generation_settings(self, config: DistillConfig) -> dict[str, Any]:
        return super().generation_settings(config) | {"guidance": _guidance(config)}

    def pipeline_call(self, settings: dict[str, Any]) -> dict[str, Any]:
        return super().pipeline_call(settings) | {"guidance_scale": float(settings["guidance"])}

    # -- dmd2 plan: FLUX.1 [dev] by hub id (nothing downloaded), a pipeline directory by its configs --

    def model_on_meta(self, path: str, dtype: torch.dtype | None = None) -> nn.Module:
        from diffusers import FluxTransformer2DModel

        from dmd2.families.flux.published import PUBLISHED
        from dmd2.model import architecture, on_meta

        if path in PUBLISHED:
            return on_meta(FluxTransformer2DModel, PUBLISHED[path][0], dtype)
        return architecture(path, dtype, subfolder="transformer")

    def planned(self, config: DistillConfig) -> "FluxFamily":
        return dataclasses.replace(self, guidance=_guidance(config), true_cfg=_true_cfg(config))

    def plan_bind(self, config: DistillConfig, device: torch.device | str) -> "FluxFamily":
        """A table of one zero prompt of the encoders' shapes ([data] max_sequence_length T5 tokens, CLIP's pooled
        vector), in host memory as `bind` keeps it."""
        transformer = pipeline._configs(config.model.teacher)[0]
        tables = [torch.zeros(1, config.data.max_sequence_length, transformer["joint_attention_dim"]),
                  torch.zeros(1, transformer["pooled_projection_dim"])]
        return dataclasses.replace(self, table=PromptTable(*tables, *(t.clone() for t in tables)))
