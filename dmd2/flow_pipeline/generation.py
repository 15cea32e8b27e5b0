"""Pictures of an exported student of a pipeline family: its pipeline directory called as its model card says (the
export's scheduler makes the stock pipeline sample as the student's sampler), seeded; uint8 pictures out (the logged
MLflow model's output)."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


@dataclass
class PipelineGenerator:
    """An exported student, loaded once: prompts in, uint8 pictures [resolution, resolution, 3] out."""

    pipeline: Any  # the teacher's pipeline class
    num_steps: int
    call: dict[str, Any]  # the pipeline call's other arguments (guidance, size, text length: the family's)

    @classmethod
    def load(cls, student_dir: Path, num_steps: int, call: dict[str, Any]) -> "PipelineGenerator":
        """On the GPU in bf16 when there is one (the text encoders alone are ~10-20 GB in fp32), else fp32."""
        import diffusers  # slow to import; only generation needs it

        from dmd2.flow_pipeline.files import read_index

        cuda = torch.cuda.is_available()
        pipeline_class = getattr(diffusers, read_index(student_dir)["_class_name"])
        pipeline = pipeline_class.from_pretrained(str(student_dir), use_safetensors=True,
                                                  dtype=torch.bfloat16 if cuda else torch.float32)
        pipeline.set_progress_bar_config(disable=True)
        return cls(pipeline.to("cuda" if cuda else "cpu"), num_steps, dict(call))

    @torch.no_grad()
    def __call__(self, inputs: list[Any], seed: int = 0) -> list[np.ndarray]:
        prompts = [str(prompt) for prompt in inputs]
        if not prompts:
            return []
        device = self.pipeline.device
        # The pipeline draws its initial noise from `generator` but the scheduler's re-noising from torch's
        # global generator: seed both, and leave the caller's global state as it was.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            # `prompt=` by name: Flux2KleinPipeline's first argument is a conditioning image
            images = self.pipeline(prompt=prompts, num_inference_steps=self.num_steps, output_type="np",
                                   generator=torch.Generator(device).manual_seed(seed), **self.call).images
        return [(np.clip(image, 0, 1) * 255).round().astype(np.uint8) for image in images]
