"""The frame of a family of flow-matching transformer pipelines (SD3, FLUX, Qwen-Image): what a run does with a
diffusers pipeline directory or hub id, written once; a family states how its pipeline differs.

`[model] teacher` is a pipeline directory or a hub id (then `[model] family`; the snapshot is fetched once by
huggingface_hub). The transformer trains; the text encoders run once per prompt set (`prepare`, on a Ray worker, by
the pipeline's own `encode_prompt`), the VAE in evaluation and export. Records carry prompt indices into one table
holding the training prompts, then the eval prompts; the negative prompt is index -1. Samples are latents of
`[data] resolution` normalised as the pipeline normalises them; the student's grid and the critic's sigmas follow
the teacher's time shift at that resolution unless the recipe sets its own.

A family gives: its pipeline classes and transformer class, `teacher_shift` (or `run_shift`), `sample_shape`,
`default_resolution`, `encode_prompts` (and `table_from` when its table is not `PromptTable`), `velocity`,
`decode_latents` (and `load_vae`), the export's card text and scheduler (and `export_index`), and how its export is
called (`pipeline_call`).
"""

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from dmd2.config import ConfigError, DistillConfig
from dmd2.eval_set import eval_prompts, planned_eval_batch
from dmd2.family import ModelFamily, RunSpec
from dmd2.flow_pipeline import files
from dmd2.flow_pipeline.export import CardText
from dmd2.flow_pipeline.prompts import PromptTable
from dmd2.pipeline_files import prompts_digest
from dmd2.prompt_file import read_prompts
from dmd2.prompt_index import PromptIndices, table_dtype, table_part


@dataclass(frozen=True)
class PipelineFamily(ModelFamily):
    pipeline_classes: ClassVar[tuple[str, ...]]
    transformer_class: ClassVar[str]  # the diffusers class of `transformer/`
    card: ClassVar[CardText]
    gate_metric = "eval/distance_teacher"  # the feature KID, else the pixel KID, to the teacher
    splits_evaluation = True  # a many-step guided teacher at 1024 px: every rank samples a share
    report_columns = {"eval/kid_teacher": "KID vs teacher", "eval/kid_teacher_se": "± SE",
                      "eval/pixel_kid_teacher": "pixel KID vs teacher", "eval/pixel_kid_teacher_se": "± SE",
                      "eval/diversity_ratio": "diversity / teacher's", "eval/clip_score": "CLIP score"}
    judges = {"eval/kid_teacher": "KID ([eval] feature_model)", "eval/pixel_kid_teacher": "pixel KID"}
    generate_example = ("a photo of a cat",)  # prompts
    generated_shape = (-1, -1, 3)  # [data] resolution, RGB
    table: Any = None  # bound on the ranks: the training prompts, then the eval prompts

    # -- what a family states ------------------------------------------------------------------------------------

    def teacher_shift(self, teacher: str, resolution: int) -> float:
        """The teacher's time shift at `resolution` (dmd2/flow_pipeline/files.py)."""
        raise NotImplementedError

    def run_shift(self, teacher: str, config: DistillConfig) -> float:
        """The shift of the run's grid and critic sigmas: the teacher's at `[data] resolution`. A family whose pipeline
        also shifts by the step count (FLUX.2 [klein]) overrides this instead, with the student's steps."""
        return self.teacher_shift(teacher, config.data.resolution)

    def sample_shape(self, teacher: str, config: DistillConfig) -> tuple[int, ...]:
        """The normalised latent shape of one sample of `[data] resolution`."""
        raise NotImplementedError

    def check_sequence_split(self, teacher: str, config: DistillConfig) -> None:
        """Refuse (ValueError) a `[train] sequence_parallel` that cannot split this teacher's samples; only a family
        that reads the option (`dmd2.family.FAMILIES`) is ever asked with more than one rank."""

    def plan_spec(self, config: DistillConfig) -> RunSpec:
        """One stand-in prompt (memory does not depend on which prompts), no prompt file read; a sequence split the
        teacher's samples cannot take refused, as the run would refuse it."""
        teacher = config.model.teacher
        try:
            shape = self.sample_shape(teacher, config)
            self.check_sequence_split(teacher, config)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        return RunSpec(config, self.planned(config), shape, PromptIndices(1), "")

    def planned(self, config: DistillConfig) -> "PipelineFamily":
        """The family as `plan_spec` hands it on (with what `run_spec` would bind from the recipe)."""
        return self

    def default_resolution(self, teacher: str) -> int:
        raise NotImplementedError

    def encode_prompts(self, pipeline: Any, prompts: list[str], negative_prompt: str,
                       max_sequence_length: int) -> dict[str, Tensor]:
        """The prompt table's tensors, encoded by the pipeline's own `encode_prompt`."""
        raise NotImplementedError

    def table_from(self, tensors: dict[str, Tensor]) -> Any:
        return PromptTable.from_tensors(tensors)

    def load_vae(self, teacher: str) -> nn.Module:
        from diffusers import AutoencoderKL

        return AutoencoderKL.from_pretrained(teacher, subfolder="vae", low_cpu_mem_usage=False, use_safetensors=True)

    def decode_latents(self, vae: nn.Module, latents: Tensor) -> Tensor:
        """Normalised latents -> pictures [N, 3, H, W] in [-1, 1] (AutoencoderKL's `scaling_factor`, `shift_factor`:
        SD3's and FLUX's)."""
        shift = vae.config.shift_factor or 0.0
        return vae.decode(latents / vae.config.scaling_factor + shift, return_dict=False)[0]

    def export_scheduler(self, config: DistillConfig) -> Any:
        """The export's scheduler, for a pipeline that passes `sigmas = linspace(1, 1/N, N)` to `set_timesteps` (FLUX,
        Qwen-Image): a fixed shift maps them onto the student's grid exactly; x0 is predicted and re-noised."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(shift=config.student.grid_shift, use_dynamic_shifting=False,
                                               stochastic_sampling=True)

    def export_index(self, index: dict[str, Any]) -> dict[str, Any]:
        """The export's model_index.json before its components are set: the teacher's (its pipeline options kept)."""
        return index

    def card_text(self, config: DistillConfig) -> CardText:
        """What the export's model card says of the pipeline (dmd2/flow_pipeline/export.py)."""
        return self.card

    def pipeline_call(self, settings: dict[str, Any]) -> dict[str, Any]:
        """The export's call arguments besides the prompts, the steps and the generator."""
        resolution = int(settings["resolution"]) or None  # 0: the pipeline's default
        call = {"guidance_scale": 1.0, "height": resolution, "width": resolution}
        if "max_sequence_length" in settings:  # else the pipeline's default
            call["max_sequence_length"] = int(settings["max_sequence_length"])
        return call

    # -- the frame -----------------------------------------------------------------------------------------------

    def resolve(self, config: DistillConfig, cache_dir: Path) -> DistillConfig:
        model = config.model
        teacher = files.local_pipeline(model.teacher)
        try:
            files.check_pipeline(teacher, self.pipeline_classes, self.name)
            resolution = config.data.resolution or self.default_resolution(teacher)
            config = config.replace("data", resolution=resolution)
            self.sample_shape(teacher, config)
            self.check_sequence_split(teacher, config)
            shift = self.run_shift(teacher, config)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        return config.with_teacher_shift(shift).replace(
            "model", family=self.name, teacher=teacher, student=model.student and files.local_pipeline(model.student),
            critic_load=model.critic_load and files.local_pipeline(model.critic_load))

    def eval_prompts(self, config: DistillConfig) -> list[str]:
        return eval_prompts(config)

    def evaluation_batch(self, config: DistillConfig, teacher: bool = False) -> int:
        return planned_eval_batch(config, teacher)

    def run_spec(self, config: DistillConfig, cache_dir: Path) -> RunSpec:
        shape = self.sample_shape(config.model.teacher, config)
        return RunSpec(config, self, shape, PromptIndices(len(read_prompts(config.data.prompts))), str(cache_dir))

    def encoder_fingerprint(self, teacher: str) -> str:
        index = files.check_pipeline(teacher, self.pipeline_classes, self.name)
        return files.components_fingerprint(teacher, index, files.text_components(index))

    def prepared_key(self, config: DistillConfig) -> str:
        prompts = read_prompts(config.data.prompts) + self.eval_prompts(config)
        key = prompts_digest(prompts, config.data.negative_prompt, self.encoder_fingerprint(config.model.teacher),
                             config.data.max_sequence_length)
        if table_dtype(config) != torch.float32:  # fp32 tables keep the key they had before tables were bf16
            key = hashlib.sha256(f"{key} {table_dtype(config)}".encode()).hexdigest()
        return key

    def load_text_pipeline(self, teacher: str) -> Any:
        """The pipeline with its text encoders and tokenizers only (diffusers skips a component passed as None)."""
        import diffusers  # slow to import; only encoding needs it

        pipeline_class = getattr(diffusers, files.read_index(teacher)["_class_name"])
        return pipeline_class.from_pretrained(teacher, transformer=None, vae=None, dtype=torch.float32,
                                              low_cpu_mem_usage=False, use_safetensors=True)

    def prepare(self, config: DistillConfig, part: tuple[int, int] = (0, 1)) -> dict[str, dict[str, Tensor]]:
        """{"prompts": the table (training prompts, then eval prompts)}, encoded by the pipeline's text encoders."""
        rows = table_part(read_prompts(config.data.prompts) + self.eval_prompts(config), part)
        return {"prompts": self.encode_table(config, rows)} if rows else {}

    def encode_table(self, config: DistillConfig, rows: list[str]) -> dict[str, Tensor]:
        """The prompt table of ``rows`` (and the negative prompt's row) in `table_dtype`, on the pipeline's text
        encoders (on the GPU where there is one)."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        pipeline = self.load_text_pipeline(config.model.teacher).to(device)
        table = self.encode_prompts(pipeline, rows, config.data.negative_prompt, config.data.max_sequence_length)
        return {name: embeds.to(table_dtype(config)) for name, embeds in table.items()}

    def bind(self, prepared: dict[str, dict[str, Tensor]], device: torch.device | str = "cpu") -> "PipelineFamily":
        """The prompt table in host memory whatever the device: a model call moves only its batch's rows to the
        device, so a GPU holds O(batch) of conditioning for any number of prompts."""
        return dataclasses.replace(self, table=self.table_from(prepared["prompts"]).to("cpu"))

    def load_model(self, path: str, dtype: torch.dtype | None = None) -> nn.Module:
        """The pipeline's transformer, each weight read straight into `dtype` (None: float32)."""
        if not files.is_pipeline(path, self.pipeline_classes):
            raise FileNotFoundError(f"{path!r} is not a {' or '.join(self.pipeline_classes)} directory (no "
                                    "model_index.json naming it)")
        import diffusers  # slow to import; only model loading needs it

        return getattr(diffusers, self.transformer_class).from_pretrained(
            str(path), subfolder="transformer", dtype=dtype or torch.float32, low_cpu_mem_usage=True,
            use_safetensors=True)

    def evaluator(self, config: DistillConfig, cache_dir: Path, device: torch.device | str = "cpu"):
        from dmd2.flow_pipeline.evaluation import PictureEvaluator

        return PictureEvaluator.build(self, config, device, cache_dir)

    def export(self, student: nn.Module, config: DistillConfig, out_dir: Path, card: dict[str, Any]) -> None:
        from dmd2.flow_pipeline.export import export_student

        recipe = {"recipe": card.get("recipe", ""), "run id": card.get("run_id", ""),
                  "rollouts": card.get("rollouts", ""), "teacher": config.model.teacher}
        export_student(self, student, config, Path(out_dir), {"recipe": recipe, "metrics": card.get("scores", {})})

    def generation_settings(self, config: DistillConfig) -> dict[str, Any]:
        return {"num_steps": config.student.num_steps, "resolution": config.data.resolution,  # the shift is exported
                "max_sequence_length": config.data.max_sequence_length}

    def student_generator(self, student_dir: Path, settings: dict[str, Any]):
        from dmd2.flow_pipeline.generation import PipelineGenerator

        return PipelineGenerator.load(student_dir, int(settings["num_steps"]), self.pipeline_call(settings))
