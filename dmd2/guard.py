"""The collapse guard: cheap per-rollout signals, named rules over them, and when a rule trips, which checkpoint
a run rolls back to (docs: RELIABILITY.md, "Collapse").

A DMD run that collapses (samples gone static, one colour, a critic loss that oscillates) keeps training and
checkpointing; nothing is non-finite. The signals come from what the stages compute anyway: the student's rollout
samples `x0_hat` (per-channel mean and spread, and the spread across samples: diversity), the critic's loss and
the student's DMD gradient norm. Rules (each named, each threshold an `[guard]` option), checked once `warmup`
rollouts have set the baseline, each tripping only after its condition held `patience` consecutive rollouts:

    diversity_drop   diversity < diversity_fraction x its early value (median of the warmup rollouts)
    signal_outlier   |signal - median| > robust_k x max(1.4826 MAD, relative_floor x abs(median)) over the window
    grad_spike       student gradient norm > grad_ratio x the window's median
    clipped_steps    more than max_clipped_fraction of the window's student steps clipped

and, at each evaluation of the weights after `step` rollouts (tripping at once: evaluations are few),

    eval_diversity   eval/diversity_ratio < eval_diversity_ratio (the families whose evaluation reports it)
    eval_distance    the family's gate distance > eval_distance_ratio x the run's best so far, and worse than its
                     first evaluation's (a distance near 0, e.g. an unbiased KID, makes ratios alone jumpy)

A rollout's signals measure the weights it started from, i.e. the checkpoint of its step. So when a rule trips
with its condition first seen at rollout `onset`, every checkpoint of step >= onset holds collapsing weights, and
a checkpoint taken while any condition held is suspect; the run goes back to the newest sound one before onset.
The guard only reads: it never changes a weight, a draw or a step of a run it does not trip.
"""

import statistics
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dmd2.failures import RunError
from dmd2.guard_config import GuardConfig

SAMPLE_MEAN, SAMPLE_SPREAD, DIVERSITY = "guard/sample_mean", "guard/sample_spread", "guard/diversity"
OUTLIER_SIGNALS = (SAMPLE_MEAN, SAMPLE_SPREAD, "critic-loss")
RESEED_STRIDE = 1_000_003  # a rolled-back run's seed moves by this per rollback: new draws after the checkpoint
MAD_TO_STD = 1.4826


class CollapseError(RunError):
    """The guard stopped the run (`[guard] on_collapse = "stop"`, or past `max_rollbacks`); nothing was exported."""


def sample_signals(x0_hat: Tensor) -> dict[str, Tensor]:
    """The student's samples [B, C, ...] as three one-element tensors (read after the step: no wait for the host):
    the mean over channels of each channel's mean and spread, and the mean over positions of the spread across the
    B samples (diversity: near 0 when every sample is the same picture)."""
    with torch.no_grad():
        x = x0_hat.detach().float()
        per_channel = x.transpose(0, 1).flatten(1)  # [C, B * positions]
        return {SAMPLE_MEAN: per_channel.mean(1).mean(), SAMPLE_SPREAD: per_channel.std(1, correction=0).mean(),
                DIVERSITY: x.std(0, correction=0).mean()}


@dataclass(frozen=True)
class Trip:
    """A rule that tripped: at `rollout`, its condition held since `onset`; `figures` says by how much."""

    rule: str
    rollout: int
    onset: int
    figures: str

    def describe(self) -> str:
        if self.rule.startswith("eval_"):  # judged on the weights of `onset` rollouts, after rollout `onset - 1`
            return (f"rule {self.rule} tripped at the evaluation after rollout {self.rollout} (the student of "
                    f"{self.onset} rollouts): {self.figures}")
        return f"rule {self.rule} tripped at rollout {self.rollout} (since rollout {self.onset}): {self.figures}"


def _robust_deviation(value: float, window: list[float], floor: float) -> tuple[float, float]:
    """(median, how many robust deviations `value` is from it)."""
    median = statistics.median(window)
    mad = statistics.median(abs(v - median) for v in window)
    scale = max(MAD_TO_STD * mad, floor * abs(median), 1e-12)
    return median, abs(value - median) / scale


@dataclass
class CollapseGuard:
    """The rules over one run's signals; `observe` each rollout's metrics in order, `rewind` on a rollback."""

    config: GuardConfig
    grad_clip: float = 0.0
    rows: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    onsets: dict[str, int] = field(default_factory=dict)  # rule -> first rollout of its current streak
    distances: list[tuple[int, float]] = field(default_factory=list)  # (step, gate distance) of each evaluation

    def conditions(self, metrics: dict[str, float]) -> dict[str, str]:
        """The rules whose condition holds for these metrics against the history, with their figures."""
        cfg, history = self.config, [values for _, values in self.rows]
        if not cfg.enabled or len(history) < cfg.warmup:
            return {}
        window, held = history[-cfg.window:], {}
        if DIVERSITY in metrics:
            early = statistics.median(row[DIVERSITY] for row in history[:cfg.warmup])
            if metrics[DIVERSITY] < cfg.diversity_fraction * early:
                held["diversity_drop"] = (f"diversity {metrics[DIVERSITY]:.4g} < {cfg.diversity_fraction:g} x early "
                                          f"{early:.4g}")
        for key in (k for k in OUTLIER_SIGNALS if k in metrics):
            median, deviations = _robust_deviation(metrics[key], [row[key] for row in window], cfg.relative_floor)
            if deviations > cfg.robust_k:
                held["signal_outlier"] = (f"{key} {metrics[key]:.4g} is {deviations:.1f} robust deviations from "
                                          f"its window's median {median:.4g} (limit {cfg.robust_k:g})")
                break
        median_norm = statistics.median(row["grad_norm"] for row in window)
        if metrics["grad_norm"] > cfg.grad_ratio * median_norm:
            held["grad_spike"] = (f"grad norm {metrics['grad_norm']:.4g} > {cfg.grad_ratio:g} x its running median "
                                  f"{median_norm:.4g}")
        if self.grad_clip > 0 and cfg.max_clipped_fraction < 1:
            norms = [row["grad_norm"] for row in window[1:]] + [metrics["grad_norm"]]
            clipped = sum(norm > self.grad_clip for norm in norms) / len(norms)
            if clipped > cfg.max_clipped_fraction:
                held["clipped_steps"] = f"{clipped:.0%} of the last {len(norms)} steps clipped"
        return held

    def observe(self, rollout_id: int, metrics: dict[str, float]) -> Trip | None:
        """Record rollout `rollout_id`'s signals; the first rule past its patience, or None."""
        held = self.conditions(metrics)
        self.onsets = {rule: self.onsets.get(rule, rollout_id) for rule in held}
        keys = (*OUTLIER_SIGNALS, DIVERSITY, "grad_norm")
        self.rows.append((rollout_id, {key: float(metrics[key]) for key in keys if key in metrics}))
        for rule, onset in self.onsets.items():
            if rollout_id - onset + 1 >= self.config.patience:
                return Trip(rule, rollout_id, onset, held[rule])
        return None

    def judge(self, step: int, scores: dict[str, float], gate: str | None) -> Trip | None:
        """The evaluation of the weights after `step` rollouts (`scores`; `gate`: the family's distance to the
        teacher, lower is closer): a trip of an evaluation rule, whose onset is `step` (those weights), or None."""
        cfg, ratio = self.config, scores.get("eval/diversity_ratio")
        if cfg.enabled and cfg.eval_diversity_ratio > 0 and ratio is not None and ratio < cfg.eval_diversity_ratio:
            return Trip("eval_diversity", step - 1, step,
                        f"eval/diversity_ratio {ratio:.3g} < {cfg.eval_diversity_ratio:g}")
        if gate not in scores:
            return None
        distance = scores[gate]
        if cfg.enabled and cfg.eval_distance_ratio > 0 and self.distances:
            best, first = min(d for _, d in self.distances), self.distances[0][1]
            if distance > cfg.eval_distance_ratio * best and distance > first:
                return Trip("eval_distance", step - 1, step,
                            f"{gate} {distance:.4g} is above {cfg.eval_distance_ratio:g} x the run's best {best:.4g} "
                            f"and above its first evaluation's {first:.4g}")
        self.distances.append((step, distance))
        return None

    @property
    def tripping(self) -> bool:
        """Whether a rule's condition holds now: a checkpoint taken now is suspect."""
        return bool(self.onsets)

    def pending(self, rollout_id: int) -> Trip | None:
        """A condition still holding when the run ends, as a trip: its student must not be the result."""
        if not self.onsets:
            return None
        rule, onset = min(self.onsets.items(), key=lambda item: item[1])
        return Trip(rule, rollout_id, onset, "its condition still held at the run's end")

    def rewind(self, step: int) -> None:
        """Forget the rollouts from `step` on (the run goes back to its checkpoint of `step`)."""
        self.rows = [(rollout, values) for rollout, values in self.rows if rollout < step]
        self.distances = [(evaluated, distance) for evaluated, distance in self.distances if evaluated <= step]
        self.onsets = {}


def rollback_step(checkpoints: dict[int, bool], trip: Trip) -> int | None:
    """The step to roll back to: the newest checkpoint (step -> suspect) before the trip's onset that is not
    suspect; None when there is none."""
    sound = [step for step, suspect in checkpoints.items() if step < trip.onset and not suspect]
    return max(sound) if sound else None


def collapse_stop(trip: Trip, rollbacks: int, config: GuardConfig) -> CollapseError:
    """The error that stops a run for `trip`, saying why it did not roll back."""
    if config.on_collapse == "stop":
        why = "[guard] on_collapse = \"stop\""
    elif rollbacks >= config.max_rollbacks:
        why = f"it rolled back {rollbacks} time(s), the limit ([guard] max_rollbacks = {config.max_rollbacks})"
    else:
        why = (f"no checkpoint before rollout {trip.onset} was taken while no rule held, so there is none to roll "
               "back to; keep [train] save_interval below [guard] warmup to have one")
    return CollapseError(f"the run is collapsing: {trip.describe()}. Stopped ({why}); nothing was exported. Lower "
                         "the learning rates, or loosen the rule's [guard] option if this run is healthy.")
