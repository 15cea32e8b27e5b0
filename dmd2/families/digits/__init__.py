"""Built-in digits data set and the project's evaluator for it (docs/architecture.md, "The digits yardstick")."""

from dmd2.families.digits.data import (
    IMAGE_SHAPE,
    NULL_CLASS,
    NUM_CLASSES,
    DigitsSplits,
    balanced_labels,
    load_digits_splits,
)
from dmd2.families.digits.evaluator import (
    DigitsClassifier,
    DigitsEvaluator,
    EvaluatorConfig,
    fd_between,
    feature_stats,
    frechet_distance,
)

__all__ = [
    "IMAGE_SHAPE",
    "NULL_CLASS",
    "NUM_CLASSES",
    "DigitsClassifier",
    "DigitsEvaluator",
    "DigitsSplits",
    "EvaluatorConfig",
    "balanced_labels",
    "fd_between",
    "feature_stats",
    "frechet_distance",
    "load_digits_splits",
]
