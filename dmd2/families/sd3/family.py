"""The SD3 family: a diffusers `StableDiffusion3Pipeline` teacher (SD3 / SD3.5), its MMDiT distilled.

`[model] teacher` is a pipeline directory or a hub id (then `[model] family = "sd3"`, and the
snapshot is fetched once by huggingface_hub). The transformer trains; the text encoders run once per
prompt set (`prepare`, on a Ray worker), the VAE in evaluation and export, and once per image set when
the GAN's discriminator reads real images (`[data] images`, encoded in `prepare` too). Records carry
prompt indices into one table holding the training prompts, then the eval prompts, then the images'
captions; the negative prompt is index -1. Samples are latents of `[data] resolution`; the student's grid and the
critic's sigmas follow the teacher's scheduler shift unless the recipe sets its own. The frame of a run is the
pipeline families' (dmd2/flow_pipeline/family.py); here is what SD3 adds: the built-in teacher, the GAN's real
images, `dmd2 plan` of the published SD3.5 MMDiTs, and an export whose scheduler is solved for `set_timesteps(N)`.
"""

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dmd2.config import DistillConfig
from dmd2.family import RunSpec
from dmd2.families.sd3.conditioning import PromptTable, TableVelocity, prompt_indices
from dmd2.families.sd3.export import CARD
from dmd2.families.sd3.image_folder import RealImage, read_image_folder
from dmd2.families.sd3.pipeline import is_sd3_pipeline, latent_shape, load_transformer, read_json, shift_of, \
    vae_scale_factor
from dmd2.families.sd3.prompt_file import read_prompts
from dmd2.families.sd3.prompts import components_fingerprint, encode_prompt_table
from dmd2.families.sd3.published import CLIP_TOKENS, TRANSFORMERS, VAE_SCALE_FACTOR
from dmd2.families.sd3.real_images import caption_rows, images_digest
from dmd2.flow_pipeline.family import PipelineFamily
from dmd2.gan import GanTap, RealSamples
from dmd2.model import DiffusersVelocity, VelocityFn
from dmd2.prompt_index import PromptIndices, table_dtype, table_part  # noqa: F401 (re-exported)

@dataclass(frozen=True)
class SD3Family(PipelineFamily):
    name = "sd3"
    pipeline_classes = ("StableDiffusion3Pipeline",)
    transformer_class = "SD3Transformer2DModel"
    card = CARD
    report_columns = {**PipelineFamily.report_columns, "eval/prompt_accuracy": "prompt accuracy"}
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")  # the MMDiT's attention (diffusers' SD3 LoRA script's)
    table: PromptTable | None = None  # bound on the ranks: the training prompts, the eval prompts, the captions
    real: RealSamples | None = None  # bound on the ranks with `[data] images`: their latents, captions' indices

    def resolve(self, config: DistillConfig, cache_dir: Path) -> DistillConfig:
        from dmd2.families.sd3.builtin.pretrain import resolve_builtin  # trains the built-in teacher when missing

        return super().resolve(config.replace("model", teacher=resolve_builtin(config.model.teacher, cache_dir)),
                               cache_dir)

    def teacher_shift(self, teacher: str, resolution: int) -> float:
        return shift_of(teacher)  # SD3's fixed shift (a dynamic one is refused: its pipeline sets no `mu`)

    def sample_shape(self, teacher: str, config: DistillConfig) -> tuple[int, ...]:
        return latent_shape(teacher, config.data.resolution)

    def default_resolution(self, teacher: str) -> int:
        transformer = read_json(Path(teacher) / "transformer" / "config.json", f"[model] teacher {teacher}")
        vae = read_json(Path(teacher) / "vae" / "config.json", f"[model] teacher {teacher}")
        return transformer["sample_size"] * vae_scale_factor(vae)

    def encode_prompts(self, pipeline: Any, prompts: list[str], negative_prompt: str,
                       max_sequence_length: int) -> dict[str, Tensor]:
        return encode_prompt_table(pipeline, prompts, negative_prompt, max_sequence_length=max_sequence_length)

    def load_text_pipeline(self, teacher: str) -> Any:
        from dmd2.families.sd3.prompts import load_text_pipeline  # refuses a pipeline without T5

        return load_text_pipeline(teacher)

    # -- dmd2 plan: the published MMDiTs by hub id (nothing downloaded), a pipeline directory by its configs --

    def model_on_meta(self, path: str, dtype: torch.dtype | None = None) -> nn.Module:
        from diffusers import SD3Transformer2DModel

        from dmd2.model import architecture, on_meta

        if path in TRANSFORMERS:
            return on_meta(SD3Transformer2DModel, TRANSFORMERS[path], dtype)
        return architecture(path, dtype, subfolder="transformer")

    def plan_spec(self, config: DistillConfig) -> RunSpec:
        """One stand-in prompt (memory does not depend on which prompts), no prompt file read."""
        teacher, transformer = config.model.teacher, self._transformer_config(config.model.teacher)
        if teacher in TRANSFORMERS:
            resolution = config.data.resolution or transformer["sample_size"] * VAE_SCALE_FACTOR
            shape = (transformer["in_channels"], resolution // VAE_SCALE_FACTOR, resolution // VAE_SCALE_FACTOR)
        else:
            shape = latent_shape(teacher, config.data.resolution or self.default_resolution(teacher))
        return RunSpec(config, self, shape, PromptIndices(1), "")

    def plan_bind(self, config: DistillConfig, device: torch.device | str) -> "SD3Family":
        """A table of one zero prompt of the encoders' shapes (CLIP's 77 tokens and `[data] max_sequence_length`
        T5 ones, the MMDiT's widths), in host memory as `bind` keeps it: what the device holds of it is each call's
        rows."""
        transformer = self._transformer_config(config.model.teacher)
        width, pooled = transformer["joint_attention_dim"], transformer["pooled_projection_dim"]
        tokens = CLIP_TOKENS + config.data.max_sequence_length
        tables = [torch.zeros(1, tokens, width, device="cpu"), torch.zeros(1, pooled, device="cpu")]
        return dataclasses.replace(self, table=PromptTable(*tables, *(t.clone() for t in tables)))

    def conditioning_tensors(self) -> list[Tensor]:
        """The real samples (`[data] images`); the prompt table is in host memory."""
        return [self.real.x0, *self.real.cond.values()] if self.real is not None else []

    @staticmethod
    def _transformer_config(teacher: str) -> dict[str, Any]:
        if teacher in TRANSFORMERS:
            return TRANSFORMERS[teacher]
        return read_json(Path(teacher) / "transformer" / "config.json", f"[model] teacher {teacher}")

    @staticmethod
    def real_images(config: DistillConfig) -> list[RealImage]:
        """The images of `[data] images` with their captions (none when unset)."""
        return read_image_folder(config.data.images) if config.data.images else []

    def prepared_key(self, config: DistillConfig) -> str:
        key = super().prepared_key(config)
        images = self.real_images(config)
        if not images:  # without real images the key is the prompts' alone: earlier runs' tables stay valid
            return key
        vae = components_fingerprint(config.model.teacher, ["vae"])
        return hashlib.sha256(f"{key} {images_digest(images, config.data.resolution, vae)}".encode()).hexdigest()

    def prepare(self, config: DistillConfig, part: tuple[int, int] = (0, 1)) -> dict[str, dict[str, Tensor]]:
        """{"prompts": the table (training prompts, eval prompts, then the captions not among them)}, and with
        `[data] images`, {"real": {"latents": [N, C, h, w] float32, "prompt_index": [N] the captions' rows}} (part
        0's)."""
        from dmd2.families.sd3.real_images import encode_images, load_vae

        images = self.real_images(config)
        rows, caption_index = caption_rows(read_prompts(config.data.prompts) + self.eval_prompts(config),
                                           [image.caption for image in images])
        rows = table_part(rows, part)
        prepared = {"prompts": self.encode_table(config, rows)} if rows else {}  # its text encoders gone after
        if images and part[0] == 0:
            vae = load_vae(config.model.teacher).to("cuda" if torch.cuda.is_available() else "cpu")
            latents = encode_images(vae, [image.path for image in images], config.data.resolution)
            prepared["real"] = {"latents": latents, "prompt_index": caption_index}
        return prepared

    def bind(self, prepared: dict[str, dict[str, Tensor]], device: torch.device | str = "cpu") -> "SD3Family":
        """The real samples on ``device``; the prompt table in host memory whatever the device (every prompt's
        embeddings, ~2.7 MB each in bf16 at SD3's widths, `table_dtype`): a model call moves only its batch's rows
        to the device (`TableVelocity`), so a GPU holds O(batch) of conditioning for any number of prompts."""
        real = prepared.get("real")
        if real is not None:
            real = RealSamples(real["latents"].to(device), prompt_indices(real["prompt_index"].to(device)))
        return dataclasses.replace(self, table=PromptTable.from_tensors(prepared["prompts"]).to("cpu"), real=real)

    def real_source(self, spec: RunSpec) -> RealSamples | None:
        """The bound images' latents, each with its caption's prompt index (`[data] images`)."""
        return self.real

    def load_model(self, path: str, dtype: torch.dtype | None = None) -> nn.Module:
        if is_sd3_pipeline(path):
            return load_transformer(path, dtype or torch.float32)
        raise FileNotFoundError(f"{path!r} is not a StableDiffusion3Pipeline directory (no model_index.json naming "
                                "StableDiffusion3Pipeline)")

    def gan_tap(self, model: nn.Module) -> GanTap:
        """The middle transformer block's image-token hidden states ([B, L, D]; a block returns
        (encoder_hidden_states, hidden_states))."""
        return GanTap(f"transformer_blocks.{len(model.transformer_blocks) // 2}", model.inner_dim, output_index=1)

    def velocity(self, model: nn.Module) -> VelocityFn:
        if self.table is None:
            raise RuntimeError("the sd3 family calls models through its prompt table: bind the prepared inputs first")
        return TableVelocity(DiffusersVelocity(model), self.table)

    def evaluator(self, config: DistillConfig, cache_dir: Path, device: torch.device | str = "cpu"):
        from dmd2.families.sd3.evaluation import SD3Evaluator

        return SD3Evaluator.build(self, config, device, cache_dir)

    def export(self, student: nn.Module, config: DistillConfig, out_dir: Path, card: dict[str, Any]) -> None:
        """StableDiffusion3Pipeline calls `set_timesteps(N)`: its export's scheduler is solved for the grid."""
        from dmd2.families.sd3.export import export_pipeline

        recipe = {"recipe": card.get("recipe", ""), "run id": card.get("run_id", ""),
                  "rollouts": card.get("rollouts", ""), "teacher": config.model.teacher}
        export_pipeline(config.model.teacher, student, config.student.num_steps, config.student.grid_shift, out_dir,
                        {"recipe": recipe, "metrics": card.get("scores", {})})
