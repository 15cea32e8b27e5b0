"""The in-process loop under the collapse guard (dmd2/guard.py): checkpoints in memory, rollback, reseed, stop.

Every `[train] save_interval` rollouts (and at the start) the student's and the critic's whole training state is
kept, marked suspect when a rule's condition held as it was taken. A trip restores the newest sound checkpoint
before the rule's onset, drops the later ones, moves the rollout seed (`RESEED_STRIDE`) and scales both learning
rates by `[guard] lr_scale`, then goes on; `on_collapse = "stop"` or a trip past `max_rollbacks` raises
`CollapseError`. A run that never trips is exactly `InProcessDistiller.run`: the guard only reads its metrics.
"""

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

from dmd2.guard import RESEED_STRIDE, CollapseGuard, Trip, collapse_stop, rollback_step
from dmd2.loop import InProcessDistiller, run_rollout
from dmd2.plan import rollout_plan
from dmd2.trainer import TrainState


@dataclass(frozen=True)
class GuardEvent:
    """One trip and what the run did: rolled back to `restored` (a checkpoint step), or stopped."""

    trip: Trip
    action: str
    restored: int | None = None


def _capture(state: TrainState) -> dict[str, Any]:
    return copy.deepcopy({"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(),
                          "scheduler": state.scheduler.state_dict(),
                          "ema": state.ema.state_dict() if state.ema is not None else None})


def _restore(state: TrainState, saved: dict[str, Any], lr_scale: float) -> None:
    state.model.load_state_dict(saved["model"])
    state.optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))
    state.scheduler.load_state_dict(copy.deepcopy(saved["scheduler"]))
    if state.ema is not None:  # its tensors, loaded in place (as a checkpoint loads them)
        for name, average in state.ema.state_dict().items():
            average.copy_(saved["ema"][name])
    state.scheduler.base_lrs = [lr * lr_scale for lr in state.scheduler.base_lrs]
    for group in state.optimizer.param_groups:
        group["lr"] *= lr_scale


@dataclass
class GuardedRun:
    """`distiller`'s rollouts under `[guard]`; `events` lists each trip, `loaded` each checkpoint step restored."""

    distiller: InProcessDistiller
    guard: CollapseGuard = None
    checkpoints: dict[int, tuple[bool, dict[str, Any]]] = field(default_factory=dict)  # step -> (suspect, states)
    events: list[GuardEvent] = field(default_factory=list)
    loaded: list[int] = field(default_factory=list)

    def __post_init__(self):
        config = self.distiller.config
        self.guard = self.guard or CollapseGuard(config.guard, config.optim.grad_clip)
        self.seed = config.train.seed

    def _save(self, step: int) -> None:
        d = self.distiller
        self.checkpoints[step] = (self.guard.tripping, {"student": _capture(d.student), "critic": _capture(d.critic)})

    def _recover(self, trip: Trip) -> int:
        """Roll back for `trip` (the step to go on from), or raise `CollapseError`."""
        cfg, rollbacks = self.distiller.config.guard, len(self.events)
        target = rollback_step({step: suspect for step, (suspect, _) in self.checkpoints.items()}, trip)
        if cfg.on_collapse == "stop" or rollbacks >= cfg.max_rollbacks or target is None:
            self.events.append(GuardEvent(trip, "stop"))
            raise collapse_stop(trip, rollbacks, cfg)
        self.checkpoints = {step: kept for step, kept in self.checkpoints.items() if step <= target}
        d, states = self.distiller, self.checkpoints[target][1]
        _restore(d.student, states["student"], cfg.lr_scale)
        _restore(d.critic, states["critic"], cfg.lr_scale)
        d.config = d.config.replace("train", seed=self.seed + RESEED_STRIDE * (rollbacks + 1))
        self.guard.rewind(target)
        self.events.append(GuardEvent(trip, "rollback", target))
        self.loaded.append(target)
        return target

    def run(self, on_rollout: Callable[[int, dict[str, float]], None] | None = None) -> None:
        """Rollouts to `[train] rollouts`; returns once they are done by a student that no rule suspects."""
        d = self.distiller
        total, interval = d.config.train.rollouts, d.config.train.save_interval
        self._save(0)
        step = 0
        while step < total:
            plan = rollout_plan(d.config, step, d.sample_shape)
            metrics = run_rollout(plan, d.config, d.student, d.critic, d.teacher, d.conds, d.real)
            trip = self.guard.observe(step, metrics)
            if on_rollout:
                on_rollout(step, metrics)
            step += 1
            if trip is None and step == total:
                trip = self.guard.pending(step - 1)
            if trip is not None:
                step = self._recover(trip)
            elif interval > 0 and step % interval == 0:
                self._save(step)
