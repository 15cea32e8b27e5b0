"""The SD3 family's evaluation: the pipeline families' picture evaluation (dmd2/flow_pipeline/evaluation.py: KID to
the teacher's many-step samples on pixels and in `[eval] feature_model`'s features, diversity, the CLIP score, a grid),
plus `eval/prompt_accuracy` with a judge that reads digits (`builtin:digits`): the fraction of samples read as the
digit their prompt names (the built-in digits-sd3 teacher's captions).
"""

import torch
from torch import Tensor

from dmd2.eval_set import DECODE_BATCH, REFERENCE_SEED_OFFSET, image_grid  # noqa: F401 (re-exported)
from dmd2.flow_pipeline.evaluation import DISTANCE, PictureEvaluator  # noqa: F401 (re-exported)


class SD3Evaluator(PictureEvaluator):
    """SD3's pictures, also scored for prompt accuracy where the judge reads digits."""

    def prompt_accuracy(self, images: Tensor) -> float | None:
        """The fraction of the eval set's pictures whose prompt names a digit that the judge reads as that digit;
        None unless the judge reads digits (`builtin:digits`) and some prompt names one."""
        judge = self.judge()
        if not hasattr(judge, "classify"):
            return None
        from dmd2.families.sd3.builtin.captions import digit_of

        named = torch.tensor([-1 if digit_of(prompt) is None else digit_of(prompt) for prompt in self.prompts])
        digits = named[self.prompt_of()]
        if not (digits >= 0).any():
            return None
        return (judge.classify(images[digits >= 0]) == digits[digits >= 0]).double().mean().item()

    def extra_scores(self, images: Tensor) -> dict[str, float]:
        accuracy = self.prompt_accuracy(images)
        return {} if accuracy is None else {"eval/prompt_accuracy": accuracy}
