"""A healthy and a collapsed "student" of the tiny SD3 teacher, scored by the SD3 evaluator: what the evaluation
tests and the registry's gate test (tests/infra/tracking/test_registry.py) compare.

Healthy: the teacher's own reference samples from other noise (another seed), a student that learnt the teacher's
distribution exactly. Collapsed: the healthy one's sample from the first noise of each prompt, for every noise of
that prompt (mode collapse: the same picture whatever the noise).
"""

from pathlib import Path

from dmd2.config import config_from_dict
from dmd2.families.sd3.evaluation import SD3Evaluator
from dmd2.families.sd3.family import SD3Family
from dmd2.families.sd3.prompts import encode_prompt_table
from dmd2.family import Evaluation

PROMPTS = ["a photo of a cat", "a red dog", "a blue sign"]


def healthy_and_collapsed(sd3_dir: Path, sd3_pipe, tmp_path: Path, samples_per_prompt: int = 4,
                          **eval_options) -> tuple[Evaluation, Evaluation]:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS))
    config = config_from_dict({
        "model": {"family": "sd3", "teacher": str(sd3_dir)}, "student": {"num_steps": 2},
        "train": {"rollout_batch_size": 10}, "data": {"prompts": str(prompts), "resolution": 16},
        "eval": {"reference_steps": 3, "prompts": PROMPTS, "samples_per_prompt": samples_per_prompt} | eval_options,
    })
    family = SD3Family().bind({"prompts": encode_prompt_table(sd3_pipe, PROMPTS + PROMPTS, "")})
    evaluator = SD3Evaluator.build(family, config, cache_dir=tmp_path / "cache")
    other_noise = SD3Evaluator.build(family, config.replace("train", seed=config.train.seed + 1))
    healthy = other_noise.teacher_samples()["reference"]
    collapsed = healthy[:len(PROMPTS)].repeat(samples_per_prompt, 1, 1, 1)  # row k P + p: prompt p's first sample
    return evaluator.score(healthy), evaluator.score(collapsed)
