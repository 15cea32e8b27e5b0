"""Run a Python file or module as if some packages were not installed (the GPU image's Python has no Ray,
Prefect, MLflow, boto3 or moto): each is None in `sys.modules`, so importing it raises ModuleNotFoundError and
`importlib.util.find_spec` answers None, as for a package that is absent, whatever this venv holds.

    python tests/bench/absent_packages.py bench/gpu.py --tiny ...      (a file)
    python tests/bench/absent_packages.py -m pytest ...                 (a module)
"""

import runpy
import sys
from pathlib import Path

# Not on the device image (the device entry's KINDS.md): what the device check must never import.
ABSENT = ("ray", "prefect", "mlflow", "boto3", "moto", "botocore", "s3fs")


def main() -> None:
    for name in ABSENT:
        sys.modules[name] = None  # type: ignore[assignment]
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, as `python -m` would
    if sys.argv[1] == "-m":
        sys.argv = sys.argv[2:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
