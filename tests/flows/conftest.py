"""The flow tests' tiny recipe (the shared fixtures are in tests/conftest.py): MLflow on sqlite, a
tiny teacher, a few rollouts of a few samples."""

from pathlib import Path

TINY_RECIPE = """
[model]
teacher = "{teacher}"
[student]
num_steps = 2
[optim]
lr = 1e-3
critic_lr = 2e-3
[dmd2]
critic_steps_per_rollout = 2
teacher_guidance_scale = 2.0
[train]
rollouts = {rollouts}
rollout_batch_size = 8
seed = 7
save_interval = 1
eval_interval = {eval_interval}
keep_rollouts = 2
[eval]
num_samples = 50
reference_steps = 4
"""


# The shared uninterrupted run's (tests/conftest.py `tiny_run`): a run compared with it uses the same.
TINY_ROLLOUTS = 4
TINY_EVAL_INTERVAL = 2


def write_recipe(path: Path, teacher: Path, rollouts: int, eval_interval: int = 0) -> Path:
    path.write_text(TINY_RECIPE.format(teacher=teacher, rollouts=rollouts, eval_interval=eval_interval))
    return path
