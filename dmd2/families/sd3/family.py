"""The SD3 family: a diffusers `StableDiffusion3Pipeline` teacher (SD3 / SD3.5), its MMDiT distilled.

`[model] teacher` is a pipeline directory or a hub id (then `[model] family = "sd3"`, and the
snapshot is fetched once by huggingface_hub). The transformer trains; the text encoders run once per
prompt set (`prepare`, on a Ray worker), the VAE only in evaluation and export. Records carry prompt
indices into one table holding the training prompts, then the eval prompts; the negative prompt is
index -1. Samples are latents of `[data] resolution`; the student's grid and the critic's sigmas
follow the teacher's scheduler shift unless the recipe sets its own.
"""

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dmd2.config import ConfigError, DistillConfig
from dmd2.draws import RolloutDraws
from dmd2.family import ModelFamily, RunSpec
from dmd2.families.sd3.conditioning import PromptTable, TableVelocity, negative_indices, prompt_indices
from dmd2.families.sd3.pipeline import (check_sd3_pipeline, is_sd3_pipeline, latent_shape, load_transformer,
                                        read_json, shift_of, vae_scale_factor)
from dmd2.families.sd3.prompt_file import read_prompts
from dmd2.families.sd3.prompts import encoder_fingerprint, prompts_digest
from dmd2.model import Cond, DiffusersVelocity, VelocityFn

EVAL_PROMPTS_DEFAULT = 4  # the first prompts of [data] prompts make the grid when [eval] prompts is unset


@dataclass(frozen=True)
class PromptIndices:
    """A CondSource: uniform prompt indices in [0, num_prompts); CFG's negative is the negative prompt."""

    num_prompts: int

    def __call__(self, draws: RolloutDraws, rows: Tensor) -> tuple[Cond, Cond]:
        return prompt_indices(draws.integers("cond", self.num_prompts, rows)), negative_indices(len(rows))


def _local(spec: str) -> str:
    """A pipeline directory for `spec`: itself when it is one, else the hub snapshot of that id."""
    if Path(spec).is_dir():
        return spec
    from huggingface_hub import snapshot_download  # a user's cluster fetches it once into the HF cache

    return snapshot_download(spec)


def _refusal(error: Exception) -> ConfigError:
    return ConfigError(str(error))


@dataclass(frozen=True)
class SD3Family(ModelFamily):
    name = "sd3"
    gate_metric = "eval/latent_mse_teacher"
    report_columns = {"eval/latent_mse_teacher": "latent MSE vs teacher", "eval/clip_score": "CLIP score"}
    generate_example = ("a photo of a cat",)  # prompts
    generated_shape = (-1, -1, 3)  # [data] resolution, RGB
    table: PromptTable | None = None  # bound on the ranks: the training prompts, then the eval prompts

    def resolve(self, config: DistillConfig, cache_dir: Path) -> DistillConfig:
        model = config.model
        teacher = _local(model.teacher)
        try:
            check_sd3_pipeline(teacher)
            shift = shift_of(teacher)
            resolution = config.data.resolution or self._default_resolution(teacher)
            latent_shape(teacher, resolution)
        except ValueError as error:
            raise _refusal(error) from None
        config = config.with_teacher_shift(shift).replace("data", resolution=resolution)
        return config.replace("model", family=self.name, teacher=teacher,
                              student=model.student and _local(model.student),
                              critic_load=model.critic_load and _local(model.critic_load))

    @staticmethod
    def _default_resolution(teacher: str) -> int:
        transformer = read_json(Path(teacher) / "transformer" / "config.json", f"[model] teacher {teacher}")
        vae = read_json(Path(teacher) / "vae" / "config.json", f"[model] teacher {teacher}")
        return transformer["sample_size"] * vae_scale_factor(vae)

    def eval_prompts(self, config: DistillConfig) -> list[str]:
        return list(config.eval.prompts) or read_prompts(config.data.prompts)[:EVAL_PROMPTS_DEFAULT]

    def run_spec(self, config: DistillConfig, cache_dir: Path) -> RunSpec:
        shape = latent_shape(config.model.teacher, config.data.resolution)
        return RunSpec(config, self, shape, PromptIndices(len(read_prompts(config.data.prompts))), str(cache_dir))

    def prepared_key(self, config: DistillConfig) -> str:
        prompts = read_prompts(config.data.prompts) + self.eval_prompts(config)
        return prompts_digest(prompts, config.data.negative_prompt, encoder_fingerprint(config.model.teacher))

    def prepare(self, config: DistillConfig) -> dict[str, dict[str, Tensor]]:
        from dmd2.families.sd3.prompts import encode_prompt_table, load_text_pipeline

        device = "cuda" if torch.cuda.is_available() else "cpu"
        pipeline = load_text_pipeline(config.model.teacher).to(device)
        prompts = read_prompts(config.data.prompts) + self.eval_prompts(config)
        return {"prompts": encode_prompt_table(pipeline, prompts, config.data.negative_prompt)}

    def bind(self, prepared: dict[str, dict[str, Tensor]], device: torch.device | str = "cpu") -> "SD3Family":
        return dataclasses.replace(self, table=PromptTable.from_tensors(prepared["prompts"]).to(device))

    def load_model(self, path: str, dtype: torch.dtype | None = None) -> nn.Module:
        if is_sd3_pipeline(path):
            return load_transformer(path, dtype or torch.float32)
        raise FileNotFoundError(f"{path!r} is not a StableDiffusion3Pipeline directory (no model_index.json naming "
                                "StableDiffusion3Pipeline)")

    def velocity(self, model: nn.Module) -> VelocityFn:
        if self.table is None:
            raise RuntimeError("the sd3 family calls models through its prompt table: bind the prepared inputs first")
        return TableVelocity(DiffusersVelocity(model), self.table)

    def evaluator(self, config: DistillConfig, cache_dir: Path):
        from dmd2.families.sd3.evaluation import SD3Evaluator

        return SD3Evaluator.build(self, config)

    def export(self, student: nn.Module, config: DistillConfig, out_dir: Path, card: dict[str, Any]) -> None:
        from dmd2.families.sd3.export import export_pipeline

        recipe = {"recipe": card.get("recipe", ""), "run id": card.get("run_id", ""),
                  "rollouts": card.get("rollouts", ""), "teacher": config.model.teacher}
        export_pipeline(config.model.teacher, student, config.student.num_steps, config.student.grid_shift, out_dir,
                        {"recipe": recipe, "metrics": card.get("scores", {})})

    def generation_settings(self, config: DistillConfig) -> dict[str, Any]:
        return {"num_steps": config.student.num_steps, "resolution": config.data.resolution}  # the shift is exported

    def student_generator(self, student_dir: Path, settings: dict[str, Any]):
        from dmd2.families.sd3.generation import SD3Generator

        return SD3Generator.load(student_dir, int(settings["num_steps"]), int(settings["resolution"]))
