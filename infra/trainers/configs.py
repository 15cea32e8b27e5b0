"""The trainer config list: one config per trainer group, computed from one `DistillConfig`.

Under DMD2 the list is ``[critic, actor]``: the critic trains first in every rollout and hands its
scores to the actor (`external_data["critic"]`). Other loss types give ``[actor]``. The input config
is never mutated (every config here is frozen).

The critic's overrides of the common base: its init is ``[model] critic_load`` (default: the
teacher), its lr ``[optim] critic_lr`` (default: ``lr``), its checkpoint dir the sibling
``<dir>_critic``, K = ``[dmd2] critic_steps_per_rollout`` optimizer steps per rollout, and the critic
hooks. The actor's only override drops the teacher, so only the critic group holds it.
Model paths are local diffusers directories (or hub ids); the caller resolves ``builtin:digits``.
"""

import dataclasses
from dataclasses import dataclass

from dmd2.config import DistillConfig

ROLES = ("critic", "actor")


@dataclass(frozen=True)
class HookPaths:
    """Dotted paths of a group's hooks (signatures: `infra.trainers.hooks`); None keeps the default."""

    loss: str | None = None
    prepare: str | None = None
    train_input: str | None = None
    train_output: str | None = None


CRITIC_HOOK_PATHS = HookPaths(
    loss="dmd2.hooks.critic_loss_hook",
    prepare="dmd2.hooks.critic_step_pairs",
    train_output="dmd2.hooks.last_kept",
)
ACTOR_HOOK_PATHS = HookPaths(loss="dmd2.hooks.actor_loss_hook", prepare="dmd2.hooks.scored_pairs")


@dataclass(frozen=True)
class TrainerConfig:
    """What one trainer group needs beyond the shared `DistillConfig`.

    role: ``"critic"`` or ``"actor"`` (also the `external_data` key later groups see).
    init: the model directory (or hub id) the trained model starts from.
    teacher: the frozen teacher's directory, or None when this group does not hold it.
    lr: the peak learning rate of this group's AdamW.
    checkpoint_dir: the folder under ``<run_id>/`` in the store that holds this group's checkpoints.
    steps_per_rollout: optimizer steps per rollout (K for the critic, 1 for the actor).
    hooks: the group's hooks.
    ema_decay: the decay of the EMA of its weights that evaluation and export use (the student's
        ``[student] ema_decay``; the critic has none); 0: none.
    """

    role: str
    init: str
    teacher: str | None
    lr: float
    checkpoint_dir: str
    steps_per_rollout: int
    hooks: HookPaths
    ema_decay: float = 0.0
    gan_head: bool = False  # the critic's GAN head (dmd2/gan.py), with [dmd2] critic_gan_weight > 0


def base_trainer_config(config: DistillConfig, checkpoint_dir: str, hooks: HookPaths) -> TrainerConfig:
    """The config every trainer starts from: the student's init and lr, holding the teacher."""
    return TrainerConfig(
        role="actor",
        init=config.model.student or config.model.teacher,
        teacher=config.model.teacher or None,
        lr=config.optim.lr,
        checkpoint_dir=checkpoint_dir,
        steps_per_rollout=1 if config.dmd2 is None else config.dmd2.actor_steps_per_rollout,
        hooks=hooks,
        ema_decay=config.student.ema_decay,
    )


def compute_trainer_configs(
    config: DistillConfig, checkpoint_dir: str = "checkpoints", actor_hooks: HookPaths | None = None
) -> list[TrainerConfig]:
    """``[critic, actor]`` under DMD2, ``[actor]`` otherwise, in training order.

    ``actor_hooks`` replaces the actor's hooks (required for loss types other than DMD2, which ship
    no actor hooks of their own here). ``checkpoint_dir`` is the actor's; the critic's is its sibling
    ``<checkpoint_dir>_critic``.
    """
    if not config.model.student and not config.model.teacher:
        raise ValueError("[model] student or [model] teacher must name the model to train")
    dmd2 = config.train.loss_type == "dmd2"
    hooks = actor_hooks or (ACTOR_HOOK_PATHS if dmd2 else HookPaths())
    base = base_trainer_config(config, checkpoint_dir, hooks)
    actor = dataclasses.replace(base, teacher=None)
    if not dmd2:
        return [actor]
    critic = dataclasses.replace(
        base,
        role="critic",
        init=config.model.critic_load or config.model.teacher,
        lr=config.critic_lr,
        checkpoint_dir=f"{checkpoint_dir}_critic",
        steps_per_rollout=config.dmd2.critic_steps_per_rollout,
        hooks=CRITIC_HOOK_PATHS,
        ema_decay=0.0,
        gan_head=config.dmd2.critic_gan_weight > 0,
    )
    return [critic, actor]
