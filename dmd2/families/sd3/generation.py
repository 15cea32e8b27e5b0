"""Images of an exported SD3 student: its `StableDiffusion3Pipeline` directory called as its model card says.

The export's scheduler makes the stock pipeline sample as the student's sampler at the student's step
count, unguided (dmd2/families/sd3/export.py); this module only makes that call, seeded, and returns
uint8 pictures (the logged MLflow model's output).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


@dataclass
class SD3Generator:
    """An exported SD3 student, loaded once: prompts in, uint8 pictures [resolution, resolution, 3] out."""

    pipeline: Any  # a StableDiffusion3Pipeline
    num_steps: int
    resolution: int  # 0: the pipeline's default (the transformer's sample size)
    max_sequence_length: int  # T5 tokens per prompt, as the student was distilled with (`[data] max_sequence_length`)

    @classmethod
    def load(cls, student_dir: Path, num_steps: int, resolution: int, max_sequence_length: int) -> "SD3Generator":
        """On the GPU in bf16 when there is one (SD3.5's text encoders alone are ~20 GB in fp32), else fp32."""
        from diffusers import StableDiffusion3Pipeline  # slow to import; only generation needs it

        cuda = torch.cuda.is_available()
        pipeline = StableDiffusion3Pipeline.from_pretrained(str(student_dir), use_safetensors=True,
                                                            dtype=torch.bfloat16 if cuda else torch.float32)
        pipeline.set_progress_bar_config(disable=True)
        return cls(pipeline.to("cuda" if cuda else "cpu"), num_steps, resolution, max_sequence_length)

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
            images = self.pipeline(prompts, num_inference_steps=self.num_steps, guidance_scale=1.0,
                                   height=self.resolution or None, width=self.resolution or None, output_type="np",
                                   max_sequence_length=self.max_sequence_length,
                                   generator=torch.Generator(device).manual_seed(seed)).images
        return [(np.clip(image, 0, 1) * 255).round().astype(np.uint8) for image in images]
