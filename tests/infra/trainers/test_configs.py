"""The trainer config list (infra/trainers/configs.py)."""

import copy
import dataclasses

from dmd2.config import config_from_dict
from infra.trainers.configs import (ACTOR_HOOK_PATHS, CRITIC_HOOK_PATHS, HookPaths, base_trainer_config,
                                  compute_trainer_configs)


def dmd2_config(**model):
    return config_from_dict({
        "model": {"teacher": "/models/teacher", **model},
        "optim": {"lr": 2e-6, "critic_lr": 8e-6},
        "dmd2": {"critic_steps_per_rollout": 5},
        "train": {"rollout_batch_size": 20},
    })


def test_critic_first_from_critic_load_at_critic_lr_with_sibling_dir_and_k_steps():
    config = dmd2_config(critic_load="/models/critic-init", student="/models/student")
    critic, actor = compute_trainer_configs(config, checkpoint_dir="ckpt")
    assert critic.role == "critic" and actor.role == "actor"
    assert critic.init == "/models/critic-init"
    assert critic.lr == 8e-6
    assert critic.checkpoint_dir == "ckpt_critic"
    assert critic.steps_per_rollout == 5
    assert critic.hooks == CRITIC_HOOK_PATHS
    assert critic.teacher == "/models/teacher"  # only the critic holds the teacher
    assert (actor.init, actor.lr, actor.checkpoint_dir, actor.steps_per_rollout) == ("/models/student", 2e-6, "ckpt", 1)


def test_actor_differs_from_the_base_only_by_dropping_the_teacher():
    config = dmd2_config()
    base = base_trainer_config(config, "checkpoints", ACTOR_HOOK_PATHS)
    _, actor = compute_trainer_configs(config)
    assert base.teacher == "/models/teacher"
    assert actor == dataclasses.replace(base, teacher=None)
    changed = [f.name for f in dataclasses.fields(base) if getattr(base, f.name) != getattr(actor, f.name)]
    assert changed == ["teacher"]


def test_critic_defaults_to_the_teacher_and_the_student_lr():
    config = config_from_dict({"model": {"teacher": "/models/teacher"}, "optim": {"lr": 3e-6},
                               "train": {"rollout_batch_size": 20}})
    critic, actor = compute_trainer_configs(config)
    assert critic.init == "/models/teacher" and critic.lr == 3e-6
    assert actor.init == "/models/teacher"  # the student starts from the teacher's weights by default


def test_input_config_is_untouched():
    config = dmd2_config(critic_load="/models/critic-init")
    before = copy.deepcopy(config)
    compute_trainer_configs(config)
    assert config == before


def test_flow_matching_gives_the_actor_only_without_the_teacher():
    config = config_from_dict({"model": {"teacher": "/models/teacher"}, "train": {"loss_type": "flow_matching"}})
    hooks = HookPaths(loss="my.hooks.fm_loss", prepare="my.hooks.all_pairs")
    [actor] = compute_trainer_configs(config, actor_hooks=hooks)
    assert actor.role == "actor" and actor.teacher is None and actor.hooks == hooks and actor.steps_per_rollout == 1
