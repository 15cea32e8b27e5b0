"""The Wan family: a diffusers `WanPipeline` teacher (Wan 2.1 T2V 1.3B / 14B, Wan 2.2 A14B's two experts), its
video transformer distilled into a few-step student.

`[model] teacher` is a pipeline directory or a hub id (then `[model] family = "wan"`; the snapshot is fetched once
by huggingface_hub). The transformer trains (for Wan 2.2 A14B both experts, as one model switching at the
pipeline's `boundary_ratio`: dmd2/families/wan/experts.py); UMT5 runs once per prompt set (`prepare`, on a Ray
worker), the VAE in evaluation. Samples are normalised latents [C, (F - 1) / 4 + 1, H / 8, W / 8] of `[data] frames`,
`height` and `width` (Wan 2.1's VAE; 2.2's own factors), per channel as the pipeline's `latents_mean` /
`latents_std` say. The teacher's UniPC scheduler's `flow_shift` is the model's time shift: the student's grid and
the critic's sigmas follow it unless the recipe sets its own.
"""

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dmd2.config import ConfigError, DistillConfig
from dmd2.eval_set import eval_prompts, planned_eval_batch
from dmd2.family import ModelFamily, RunSpec
from dmd2.prompt_file import read_prompts
from dmd2.families.wan.checks import check_student_expert
from dmd2.families.wan.pipeline import (check_sequence_split, experts, flow_shift_of, is_wan_pipeline, latent_shape,
                                       video_size)
from dmd2.families.wan.prompts import table_key
from dmd2.flow_pipeline.prompts import StatesTable
from dmd2.model import DiffusersVelocity, VelocityFn
from dmd2.pipeline_files import read_json
from dmd2.prompt_index import PromptIndices, TableVelocity, table_dtype, table_part


def _local(spec: str) -> str:
    """A pipeline directory for `spec`: itself when it is one, else the hub snapshot of that id."""
    if Path(spec).is_dir():
        return spec
    from huggingface_hub import snapshot_download  # a user's cluster fetches it once into the HF cache

    return snapshot_download(spec)


@dataclass(frozen=True)
class WanFamily(ModelFamily):
    name = "wan"
    gate_metric = "eval/distance_teacher"  # the pixel KID of the videos to the teacher's (evaluation.py)
    splits_evaluation = True  # a many-step guided teacher over 81 frames: every rank samples a share
    report_columns = {"eval/pixel_kid_teacher": "pixel KID vs teacher", "eval/pixel_kid_teacher_se": "± SE",
                      "eval/diversity_ratio": "diversity / teacher's", "eval/motion_ratio": "motion / teacher's"}
    judges = {"eval/pixel_kid_teacher": "pixel KID"}
    generate_example = ("a cat runs on the grass",)  # prompts
    generated_shape = (-1, -1, -1, 3)  # frames, height, width, RGB
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")  # the attention layers (diffusers' Wan LoRA loaders')
    table: StatesTable | None = None  # bound on the ranks: the training prompts, then the eval prompts

    def resolve(self, config: DistillConfig, cache_dir: Path) -> DistillConfig:
        model = config.model
        teacher = _local(model.teacher)
        try:
            shift = flow_shift_of(teacher)
            latent_shape(teacher, *video_size(config.data))
            check_sequence_split(teacher, *video_size(config.data), config.train.sequence_parallel)  # a hub snapshot
            check_student_expert(config, one_transformer=experts(teacher)[1] is None)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        return config.with_teacher_shift(shift).replace(
            "model", family=self.name, teacher=teacher, student=model.student and _local(model.student),
            critic_load=model.critic_load and _local(model.critic_load))

    def eval_prompts(self, config: DistillConfig) -> list[str]:
        return eval_prompts(config)

    def evaluation_batch(self, config: DistillConfig, teacher: bool = False) -> int:
        return planned_eval_batch(config, teacher)

    def run_spec(self, config: DistillConfig, cache_dir: Path) -> RunSpec:
        shape = latent_shape(config.model.teacher, *video_size(config.data))
        return RunSpec(config, self, shape, PromptIndices(len(read_prompts(config.data.prompts))), str(cache_dir))

    # -- dmd2 plan: the published Wan 2.1 transformers by hub id (nothing downloaded), a directory by its configs --

    def model_on_meta(self, path: str, dtype: torch.dtype | None = None) -> nn.Module:
        from dmd2.families.wan.experts import wan_on_meta
        from dmd2.families.wan.published import TRANSFORMERS

        if path in TRANSFORMERS:
            from diffusers import WanTransformer3DModel

            from dmd2.model import on_meta

            return on_meta(WanTransformer3DModel, TRANSFORMERS[path], dtype)
        return wan_on_meta(path, dtype)

    def plan_spec(self, config: DistillConfig) -> RunSpec:
        """One stand-in prompt (memory does not depend on which prompts), no prompt file read; a sequence split the
        teacher's videos cannot take refused, as the run would refuse it."""
        teacher, size = config.model.teacher, video_size(config.data)
        try:
            shape = latent_shape(teacher, *size)
            check_sequence_split(teacher, *size, config.train.sequence_parallel)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        return RunSpec(config, self, shape, PromptIndices(1), "")

    def plan_bind(self, config: DistillConfig, device: torch.device | str) -> "WanFamily":
        """A table of one zero prompt of UMT5's shape ([data] max_sequence_length tokens of the text width)."""
        from dmd2.families.wan.published import TRANSFORMERS

        teacher = config.model.teacher
        transformer = TRANSFORMERS.get(teacher) or read_json(Path(teacher) / "transformer" / "config.json",
                                                             "[model] teacher")
        zeros = torch.zeros(1, config.data.max_sequence_length, transformer["text_dim"], device="cpu")
        return dataclasses.replace(self, table=StatesTable(zeros, zeros.clone()))

    def prepared_key(self, config: DistillConfig) -> str:
        prompts = read_prompts(config.data.prompts) + self.eval_prompts(config)
        return table_key(prompts, config.data.negative_prompt, config.model.teacher, config.data.max_sequence_length,
                         table_dtype(config))

    def prepare(self, config: DistillConfig, part: tuple[int, int] = (0, 1)) -> dict[str, dict[str, Tensor]]:
        """{"prompts": the table (training prompts, then eval prompts)}, encoded by the pipeline's UMT5."""
        from dmd2.families.wan.prompts import encode_prompt_table, load_text_pipeline

        rows = table_part(read_prompts(config.data.prompts) + self.eval_prompts(config), part)
        if not rows:
            return {}
        pipeline = load_text_pipeline(config.model.teacher).to("cuda" if torch.cuda.is_available() else "cpu")
        table = encode_prompt_table(pipeline, rows, config.data.negative_prompt, config.data.max_sequence_length)
        return {"prompts": {name: embeds.to(table_dtype(config)) for name, embeds in table.items()}}

    def bind(self, prepared: dict[str, dict[str, Tensor]], device: torch.device | str = "cpu") -> "WanFamily":
        """The prompt table in host memory whatever the device: a model call moves its batch's rows there
        (`TableVelocity`)."""
        return dataclasses.replace(self, table=StatesTable.from_tensors(prepared["prompts"]).to("cpu"))

    def load_model(self, path: str, dtype: torch.dtype | None = None) -> nn.Module:
        if not is_wan_pipeline(path):
            raise FileNotFoundError(f"{path!r} is not a WanPipeline directory (no model_index.json naming WanPipeline)")
        from dmd2.families.wan.experts import load_wan_model

        return load_wan_model(path, dtype)

    def trained_part(self, model: nn.Module, role: str, config: DistillConfig) -> nn.Module:
        """With `[student] expert`, the student is that expert of a two-expert init (a one-transformer init, e.g. an
        export of such a student, is that expert already); the critic keeps both."""
        from dmd2.families.wan.experts import WanExperts

        expert = config.student.expert
        return getattr(model, expert) if role == "actor" and expert and isinstance(model, WanExperts) else model

    def velocity(self, model: nn.Module) -> VelocityFn:
        if self.table is None:
            raise RuntimeError("the wan family calls models through its prompt table: bind the prepared inputs first")
        return TableVelocity(DiffusersVelocity(model), self.table)

    def evaluator(self, config: DistillConfig, cache_dir: Path, device: torch.device | str = "cpu"):
        from dmd2.families.wan.evaluation import WanEvaluator

        return WanEvaluator.build(self, config, device, cache_dir)

    def export(self, student: nn.Module, config: DistillConfig, out_dir: Path, card: dict[str, Any]) -> None:
        from dmd2.families.wan.export import export_pipeline

        recipe = {"recipe": card.get("recipe", ""), "run id": card.get("run_id", ""),
                  "rollouts": card.get("rollouts", ""), "teacher": config.model.teacher}
        export_pipeline(config.model.teacher, student, config.student.num_steps, config.student.grid_shift, out_dir,
                        {"recipe": recipe, "metrics": card.get("scores", {})})

    def generation_settings(self, config: DistillConfig) -> dict[str, Any]:
        frames, height, width = video_size(config.data)
        return {"num_steps": config.student.num_steps, "frames": frames, "height": height, "width": width,
                "max_sequence_length": config.data.max_sequence_length}

    def student_generator(self, student_dir: Path, settings: dict[str, Any]):
        from dmd2.families.wan.generation import WanGenerator

        return WanGenerator.load(student_dir, settings)
