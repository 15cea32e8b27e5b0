"""Videos of an exported Wan student: its `WanPipeline` directory called as its model card says (the export's
scheduler makes the stock pipeline sample as the student's sampler, unguided), seeded; uint8 videos out (the logged
MLflow model's output)."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


@dataclass
class WanGenerator:
    """An exported Wan student, loaded once: prompts in, uint8 videos [frames, height, width, 3] out."""

    pipeline: Any  # a WanPipeline
    settings: dict[str, Any]  # num_steps, frames, height, width, max_sequence_length (`WanFamily.generation_settings`)

    @classmethod
    def load(cls, student_dir: Path, settings: dict[str, Any]) -> "WanGenerator":
        """On the GPU in bf16 when there is one, else fp32."""
        from diffusers import WanPipeline  # slow to import; only generation needs it

        cuda = torch.cuda.is_available()
        pipeline = WanPipeline.from_pretrained(str(student_dir), use_safetensors=True,
                                               dtype=torch.bfloat16 if cuda else torch.float32)
        pipeline.set_progress_bar_config(disable=True)
        return cls(pipeline.to("cuda" if cuda else "cpu"), dict(settings))

    @torch.no_grad()
    def __call__(self, inputs: list[Any], seed: int = 0) -> list[np.ndarray]:
        prompts = [str(prompt) for prompt in inputs]
        if not prompts:
            return []
        device, settings = self.pipeline.device, self.settings
        # The pipeline draws its initial noise from `generator` but the scheduler's re-noising from torch's global
        # generator: seed both, and leave the caller's global state as it was.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            videos = self.pipeline(prompts, num_inference_steps=int(settings["num_steps"]), guidance_scale=1.0,
                                   num_frames=int(settings["frames"]), height=int(settings["height"]),
                                   width=int(settings["width"]), output_type="np",
                                   max_sequence_length=int(settings["max_sequence_length"]),
                                   generator=torch.Generator(device).manual_seed(seed)).frames
        return [(np.clip(video, 0, 1) * 255).round().astype(np.uint8) for video in videos]
