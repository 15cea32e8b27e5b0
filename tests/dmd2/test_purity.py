"""dmd2/ is the algorithm in pure torch: it must not import orchestration, storage or tracking code."""

import ast
from pathlib import Path

FORBIDDEN = {"prefect", "ray", "fsspec", "s3fs", "mlflow", "infra", "tasks", "flows"}


def test_dmd2_imports_no_orchestration_storage_or_tracking():
    root = Path(__file__).resolve().parents[2] / "dmd2"
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert list(root.rglob("*.py")), "no dmd2 sources found"
    assert not offenders, offenders
