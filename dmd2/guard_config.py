"""`[guard]`: the collapse guard's rules and recovery (dmd2/guard.py), torch-free so a recipe validates cheaply."""

from dataclasses import dataclass

from dmd2.config_rules import ConfigError, option

ON_COLLAPSE = ("rollback", "stop")


@dataclass(frozen=True)
class GuardConfig:
    """Rules over cheap per-rollout signals that tell a collapsing run (dmd2/guard.py), and what it then does."""

    enabled: bool = option(True, "Watch the signals; false: no rule is checked (the signals are still logged).")
    on_collapse: str = option("rollback", "`rollback`: load the last checkpoint not taken while a rule was "
                                          "tripping, reseed the rollouts after it and go on; `stop`: fail the run "
                                          "naming the rule.")
    max_rollbacks: int = option(2, "Rollbacks a run may make; the next trip stops it, naming the rule and figures.")
    lr_scale: float = option(1.0, "Both learning rates are multiplied by this at each rollback (e.g. 0.5).")
    warmup: int = option(20, "Rollouts before any rule applies; they also set the early diversity.")
    window: int = option(50, "Rollouts of the running window that the robust rules compare a rollout with.")
    patience: int = option(3, "Consecutive rollouts a rule's condition must hold before it trips.")
    diversity_fraction: float = option(0.2, "`diversity_drop`: the spread across the student's samples below this "
                                            "fraction of its early value (median over the warmup).")
    robust_k: float = option(12.0, "`signal_outlier`: a signal (sample mean, sample spread, critic loss) beyond this "
                                   "many robust deviations (1.4826 x MAD) of its running window's median.")
    relative_floor: float = option(0.05, "The smallest robust deviation, as a fraction of the window's absolute "
                                         "median: a signal that barely moved in its window is not an outlier for a "
                                         "tiny move.")
    grad_ratio: float = option(20.0, "`grad_spike`: the student's gradient norm above this many times its running "
                                     "median.")
    max_clipped_fraction: float = option(1.0, "`clipped_steps`: more than this fraction of the window's student "
                                              "steps clipped by `[optim] grad_clip`; 1: off (DMD steps often clip).")
    eval_diversity_ratio: float = option(0.5, "`eval_diversity`: an evaluation whose `eval/diversity_ratio` (the "
                                              "student's spread over noises / the teacher's; families with prompts) "
                                              "is below this; 0: off.")
    eval_distance_ratio: float = option(3.0, "`eval_distance`: an evaluation whose gate distance to the teacher is "
                                             "above this many times the run's best so far, and above its first "
                                             "evaluation's; 0: off.")

    def __post_init__(self):
        problems = [  # (holds, what must hold, the options it reads)
            (self.on_collapse in ON_COLLAPSE, f"[guard] on_collapse must be one of {ON_COLLAPSE}", "on_collapse"),
            (self.max_rollbacks >= 0, "[guard] max_rollbacks must be >= 0 (0: the first trip stops the run)",
             "max_rollbacks"),
            (0 < self.lr_scale <= 1, "[guard] lr_scale must be in (0, 1]", "lr_scale"),
            (self.warmup >= 1 and self.window >= 2 and self.patience >= 1,
             "[guard] warmup >= 1, window >= 2 and patience >= 1", "warmup window patience"),
            (0 < self.diversity_fraction < 1, "[guard] diversity_fraction must be in (0, 1)", "diversity_fraction"),
            (self.robust_k > 0 and self.relative_floor >= 0 and self.grad_ratio > 1,
             "[guard] robust_k > 0, relative_floor >= 0, grad_ratio > 1", "robust_k relative_floor grad_ratio"),
            (0 < self.max_clipped_fraction <= 1, "[guard] max_clipped_fraction must be in (0, 1]",
             "max_clipped_fraction"),
            (0 <= self.eval_diversity_ratio < 1, "[guard] eval_diversity_ratio must be in [0, 1) (0: off)",
             "eval_diversity_ratio"),
            (self.eval_distance_ratio == 0 or self.eval_distance_ratio > 1,
             "[guard] eval_distance_ratio must be 0 (off) or > 1", "eval_distance_ratio"),
        ]
        for holds, message, names in problems:
            if not holds:
                got = ", ".join(f"{name} = {getattr(self, name)!r}" for name in names.split())
                raise ConfigError(f"{message}; got {got}")
