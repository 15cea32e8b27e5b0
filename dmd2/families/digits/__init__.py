"""Built-in digits data set and the project's evaluator for it (docs/architecture.md, "The digits yardstick").

The names below load on first use (`dmd2.lazy`), so importing the package, or its light checks, imports no torch.
"""

from dmd2.lazy import lazy_exports

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
__getattr__, __dir__ = lazy_exports(__name__, {
    "checks": ["IMAGE_SHAPE", "NULL_CLASS", "NUM_CLASSES"],
    "data": ["DigitsSplits", "balanced_labels", "load_digits_splits"],
    "evaluator": ["DigitsClassifier", "DigitsEvaluator", "EvaluatorConfig", "fd_between", "feature_stats",
                  "frechet_distance"],
})
