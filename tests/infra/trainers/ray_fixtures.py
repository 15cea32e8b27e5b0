"""Helpers of the trainer-group tests: tiny configs, run specs, stores. The tiny teacher (`tiny_teacher`) and
the session's one local Ray (`shared_ray`) are tests/conftest.py's fixtures; modules needing another cluster (the
simulated multi-node one, a pretend GPU) shut it down and start theirs.
"""

import tempfile
from pathlib import Path

import torch

from dmd2.config import DistillConfig, config_from_dict
from dmd2.family import RunSpec, family_for
from infra.store import ArtifactStore


def tiny_config(teacher: str, world_size: int, **train) -> DistillConfig:
    """DMD2 on the tiny teacher: 8 samples per rollout, K = 2, a 2-step student, visible lrs."""
    return config_from_dict({
        "model": {"teacher": teacher},
        "student": {"num_steps": 2},
        "optim": {"lr": 1e-4, "critic_lr": 2e-4, "warmup_steps": 2},
        "dmd2": {"critic_steps_per_rollout": 2, "teacher_guidance_scale": 2.0},
        "train": {"rollout_batch_size": 8, "world_size": world_size, "rollouts": 2, **train},
    })


def run_spec(config: DistillConfig) -> RunSpec:
    """What the run's groups share, from the recipe's family (resolved through the registry, as the flow does)."""
    return family_for(config.model).run_spec(config, Path(tempfile.gettempdir()) / "dmd2-test-cache")


def new_store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(f"file://{tmp_path / 'store'}")


def max_abs_diff(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    """The largest |difference| over every parameter; both state dicts must have the same keys."""
    assert first.keys() == second.keys()
    return max((first[k].float() - second[k].float()).abs().max().item() for k in first)
