"""Images of an exported SD3 student: its `StableDiffusion3Pipeline` directory called as its model card says
(dmd2/flow_pipeline/generation.py), unguided."""

from pathlib import Path

from dmd2.flow_pipeline.generation import PipelineGenerator


class SD3Generator(PipelineGenerator):
    """An exported SD3 student, loaded once: prompts in, uint8 pictures [resolution, resolution, 3] out."""

    @classmethod
    def load(cls, student_dir: Path, num_steps: int, resolution: int, max_sequence_length: int) -> "SD3Generator":
        """`resolution` 0: the pipeline's default; `max_sequence_length`: T5 tokens per prompt, as distilled."""
        return super().load(student_dir, num_steps, {"guidance_scale": 1.0, "height": resolution or None,
                                                     "width": resolution or None,
                                                     "max_sequence_length": max_sequence_length})
