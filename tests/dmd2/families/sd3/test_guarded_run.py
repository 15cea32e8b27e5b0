"""The collapse guard on the SD3 family: a healthy run of recipes/sd35-medium-4step.toml's options (the tiny
pipeline at 16 px, the suite's learning rates), built as its ranks build theirs, trips no rule once past the
guard's warmup, and trains the unguarded run's student bit for bit (the guard only reads). bench/guard.py runs
the same at 200 rollouts and three seeds (BENCHMARKS.md)."""

import torch

from dmd2.config import load_recipe
from dmd2.families.sd3.family import SD3Family
from dmd2.families.sd3.prompts import encode_prompt_table
from dmd2.guarded_loop import GuardedRun
from dmd2.loop import InProcessDistiller
from flows.recipe import RECIPES

PROMPTS = ["a photo of a cat", "a red dog", "a blue sign"]
ROLLOUTS = 24  # past a warmup of 6 into a window of 12: every rule is checked on most rollouts


def _distiller(sd3_dir, sd3_pipe, tmp_path, enabled: bool) -> InProcessDistiller:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    config = load_recipe(RECIPES / "sd35-medium-4step.toml", {
        "model": {"teacher": str(sd3_dir)}, "data": {"prompts": str(prompts), "resolution": 16},
        "train": {"world_size": 1, "rollout_batch_size": 8, "rollouts": ROLLOUTS, "save_interval": 4},
        "dmd2": {"critic_steps_per_rollout": 2}, "optim": {"lr": 1e-3, "critic_lr": 2e-3},
        "guard": {"enabled": enabled, "warmup": 6, "window": 12}})
    family = SD3Family()
    config = family.resolve(config, tmp_path / "cache")
    family = family.bind({"prompts": encode_prompt_table(sd3_pipe, PROMPTS, "")})
    return InProcessDistiller.for_family(config, family, tmp_path / "cache")


def test_a_healthy_sd3_run_never_trips_and_its_student_is_the_unguarded_one_bit_for_bit(sd3_dir, sd3_pipe, tmp_path):
    guarded, rows = GuardedRun(_distiller(sd3_dir, sd3_pipe, tmp_path, enabled=True)), []
    guarded.run(lambda rollout_id, metrics: rows.append(metrics))
    plain = _distiller(sd3_dir, sd3_pipe, tmp_path, enabled=False)
    plain.run(range(ROLLOUTS))

    assert guarded.events == [] and len(rows) == ROLLOUTS
    assert all(key in rows[-1] for key in ("guard/diversity", "guard/sample_mean", "grad_norm"))  # it watched
    trained = guarded.distiller.student.model.state_dict()
    assert any(not torch.equal(trained[name], weight) for name, weight in sd3_pipe.transformer.state_dict().items())
    for name, weight in plain.student.model.state_dict().items():
        assert torch.equal(trained[name], weight), name
