"""What the flux family accepts, decided from the pipeline's JSON files and the prompt file alone (standard library:
the CLI asks `claims` and `check` through the registry before anything heavy loads)."""

from dmd2.config import DistillConfig
from dmd2.families.flux.pipeline import (PIPELINE_CLASSES, check_flux_pipeline, check_sequence_split,
                                         default_resolution, latent_shape, teacher_shift)
from dmd2.families.flux.published import PUBLISHED
from dmd2.flow_pipeline.checks import check_recipe
from dmd2.flow_pipeline.files import is_pipeline


def claims(teacher: str) -> bool:
    """Whether `[model] teacher` is a local FluxPipeline directory."""
    return is_pipeline(teacher, PIPELINE_CLASSES)


def check(config: DistillConfig) -> None:
    """Refuse teachers, students, critics, prompt files and options the family cannot run with."""
    def check_split(teacher: str) -> None:
        resolution = config.data.resolution or default_resolution(teacher)
        check_sequence_split(teacher, resolution, config.data.max_sequence_length, config.train.sequence_parallel)

    def check_teacher(teacher: str) -> None:
        check_flux_pipeline(teacher)
        resolution = config.data.resolution or default_resolution(teacher)
        latent_shape(teacher, resolution)
        teacher_shift(teacher, resolution)  # the scheduler's checks, and its mu at this resolution

    check_recipe(config, "flux", PIPELINE_CLASSES, check_teacher, check_split, PUBLISHED)
