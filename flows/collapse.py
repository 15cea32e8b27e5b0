"""The collapse guard in the distill flow (its signals and rules: dmd2/guard.py; RELIABILITY.md, "Collapse").

The flow hands the guard each rollout's metrics and each evaluation's scores. Before each checkpoint is taken, the
guard's record `<run_id>/guard.json` in the store is rewritten: the signals and distances so far, which checkpoints
were taken while a rule's condition held (suspect), and each trip and what the run did; so a resumed run (a new
process, new groups after a lost rank) goes on with them. When a rule trips, the run loads the newest sound
checkpoint before the rule's onset; the checkpoints after it move to the store's quarantine (kept for a look, never
resumed from); every rank draws its rollouts from a new seed at `[guard] lr_scale` x its learning rates, and the
rollouts from there run again. With `on_collapse = "stop"`, past `max_rollbacks`, or with no sound checkpoint to go
back to, `CollapseError` stops the run before anything is exported or registered. Each trip is an MLflow tag and
metric and a Prefect artifact.
"""

from dataclasses import dataclass, field
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from dmd2.config import DistillConfig
from dmd2.guard import RESEED_STRIDE, CollapseGuard, Trip, collapse_stop, rollback_step
from flows.outputs import artifact_key
from infra.store import ArtifactStore
from infra.tracking import RunTracker
from infra.trainers import Groups, load_groups

GUARD_RECORD = "guard.json"


@dataclass
class RunGuard:
    """One distill run's guard: its rules' state, the suspect marks of its checkpoints, its events."""

    store: ArtifactStore
    run_id: str
    config: DistillConfig
    guard: CollapseGuard
    gate: str | None = None  # the family's distance to the teacher, which the `eval_distance` rule watches
    suspects: dict[int, bool] = field(default_factory=dict)  # checkpoint step -> taken while a condition held
    events: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def resume(cls, store: ArtifactStore, run_id: str, config: DistillConfig, start: int,
               gate: str | None = None) -> "RunGuard":
        """The guard of a run going on from its checkpoint of `start` (0: a new run): what the record says up to
        there. A rule's streak starts over (its condition is checked afresh from `start`)."""
        record = store.find_json(f"{run_id}/{GUARD_RECORD}") or {}
        guard = CollapseGuard(config.guard, config.optim.grad_clip,
                              rows=[(rollout, values) for rollout, values in record.get("rows", [])],
                              distances=[(step, distance) for step, distance in record.get("distances", [])])
        guard.rewind(start)
        suspects = {int(step): suspect for step, suspect in record.get("suspects", {}).items() if int(step) <= start}
        return cls(store, run_id, config, guard, gate, suspects, record.get("events", []))

    @property
    def rollbacks(self) -> int:
        return sum(event["action"] == "rollback" for event in self.events)

    def retune(self, groups: Groups) -> None:
        """After a rollback, or a resume of a run that rolled back: the rollouts' seed and the learning rates of
        its latest rollback (a run that never tripped keeps the recipe's)."""
        if self.rollbacks:
            seed = self.config.train.seed + RESEED_STRIDE * self.rollbacks
            for group in (groups.actor, groups.critic):
                if group is not None:
                    group.retune(seed, self.config.guard.lr_scale ** self.rollbacks)

    def observe(self, rollout_id: int, metrics: dict[str, float], last: bool) -> Trip | None:
        """Rollout `rollout_id`'s signals; a trip, or None. At the run's `last` rollout a condition that holds at
        all is a trip: the student it would export is suspect."""
        trip = self.guard.observe(rollout_id, metrics)
        return self.guard.pending(rollout_id) if trip is None and last else trip

    def judge(self, step: int, scores: dict[str, float]) -> Trip | None:
        """The evaluation of the weights after `step` rollouts: a trip of an evaluation rule, or None."""
        trip = self.guard.judge(step, scores, self.gate)
        self._save()
        return trip

    def checkpointing(self, step: int) -> None:
        """Record that the checkpoint of `step` is being taken (suspect if a rule's condition holds), before it is:
        a checkpoint the record does not know is never a rollback's target."""
        self.suspects[step] = self.guard.tripping
        self._save()

    def recover(self, trip: Trip, groups: Groups, tracker: RunTracker) -> int:
        """Roll the run back for `trip`; the rollout to go on from. Raises `CollapseError` to stop it."""
        cfg, logger = self.config.guard, get_run_logger()
        stored = set(self.store.list_checkpoints(self.run_id))
        target = rollback_step({step: suspect for step, suspect in self.suspects.items() if step in stored}, trip)
        stop = cfg.on_collapse == "stop" or self.rollbacks >= cfg.max_rollbacks or target is None
        if stop:
            error = collapse_stop(trip, self.rollbacks, cfg)
            self._event(trip, "stop", None, tracker)
            raise error
        self._event(trip, "rollback", target, tracker)
        for step in sorted(stored):
            if step > target:
                self.store.quarantine_checkpoint(self.run_id, step)
        self.suspects = {step: suspect for step, suspect in self.suspects.items() if step <= target}
        self.store.prune(self.run_id, keep_last=0)  # the rollouts made from the collapsing weights
        load_groups(groups, self.store.checkpoint_ref(self.run_id, target))
        self.retune(groups)
        self.guard.rewind(target)
        tracker.relog_from(target)
        self._save()
        logger.warning("run %s: %s. Rolled back to the checkpoint after %d rollouts (rollback %d of %d); the later "
                       "checkpoints are in the store's quarantine", self.run_id, trip.describe(), target,
                       self.rollbacks, cfg.max_rollbacks)
        return target

    def _event(self, trip: Trip, action: str, target: int | None, tracker: RunTracker) -> None:
        event = {"rule": trip.rule, "rollout": trip.rollout, "onset": trip.onset, "figures": trip.figures,
                 "action": action, "restored": target}
        self.events.append(event)
        self._save()
        what = f"rolled back to the checkpoint after {target} rollouts" if action == "rollback" else "stopped"
        tracker.set_tags({"dmd2.guard": f"{trip.describe()}; {what}"})
        tracker.log_metrics(trip.rollout, {"guard/trips": len(self.events), "guard/rollbacks": self.rollbacks})
        lines = [f"# Collapse guard: run `{self.run_id}`", "",
                 *(f"- {Trip(e['rule'], e['rollout'], e['onset'], e['figures']).describe()}; "
                   + (f"rolled back to step {e['restored']}" if e["action"] == "rollback" else "stopped")
                   for e in self.events)]
        create_markdown_artifact("\n".join(lines), key=artifact_key(f"guard-{self.run_id}"),
                                 description=f"collapse guard events of distill run {self.run_id}")

    def _save(self) -> None:
        self.store.put_json(f"{self.run_id}/{GUARD_RECORD}", {
            "rows": [[rollout, values] for rollout, values in self.guard.rows],
            "distances": [[step, distance] for step, distance in self.guard.distances],
            "suspects": {str(step): suspect for step, suspect in self.suspects.items()}, "events": self.events})
