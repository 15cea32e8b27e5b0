"""Where a rollout's conditionings come from: a `CondSource` maps rows of the global batch to
(cond, neg_cond). Class-conditional models draw labels; the negative is the null class CFG trained on.
"""

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from dmd2.draws import RolloutDraws
from dmd2.model import Cond


class CondSource(Protocol):
    def __call__(self, draws: RolloutDraws, rows: Tensor) -> tuple[Cond, Cond]: ...


@dataclass(frozen=True)
class ClassLabels:
    """Uniform class labels in [0, num_classes); the negative conditioning is `null_class`."""

    num_classes: int
    null_class: int

    def __call__(self, draws: RolloutDraws, rows: Tensor) -> tuple[Cond, Cond]:
        labels = draws.integers("cond", self.num_classes, rows)
        return {"class_labels": labels}, {"class_labels": torch.full_like(labels, self.null_class)}

    def for_labels(self, labels: Tensor) -> tuple[Cond, Cond]:
        """The conds of given labels (sampling and evaluation)."""
        return {"class_labels": labels}, {"class_labels": torch.full_like(labels, self.null_class)}
