"""The layout's two rules (docs/architecture.md §3), checked on every import statement, including
those inside functions:

- imports point one way: flows -> tasks -> infra -> dmd2 (a layer imports only the layers after it);
- the family boundary: only `dmd2/families/<name>/` imports its own family's code; everything else
  reaches a family through the registry in `dmd2/family.py`, by name.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["flows", "tasks", "infra", "dmd2"]  # each may import only those to its right


def imports_of(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def layer_violations(root: Path) -> list[str]:
    found = []
    for index, layer in enumerate(LAYERS):
        above = set(LAYERS[:index])
        for path in sorted((root / layer).rglob("*.py")):
            found += [f"{path.relative_to(root)} imports {name}" for name in imports_of(path)
                      if name.split(".")[0] in above]
    return found


def family_of(path: Path, root: Path) -> str | None:
    """The family a source file belongs to (dmd2/families/<name>/...), or None."""
    parts = path.relative_to(root).parts
    return parts[2] if parts[:2] == ("dmd2", "families") and len(parts) > 3 else None


def family_violations(root: Path) -> list[str]:
    found = []
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            own = family_of(path, root)
            for name in imports_of(path):
                parts = name.split(".")
                if parts[:2] == ["dmd2", "families"] and len(parts) > 2 and parts[2] != own:
                    found.append(f"{path.relative_to(root)} imports {name}")
    return found


def test_imports_point_one_way():
    assert (ROOT / "flows").is_dir() and (ROOT / "dmd2" / "families").is_dir()
    assert layer_violations(ROOT) == []


def test_only_a_family_imports_its_own_code():
    assert family_violations(ROOT) == []


def test_the_checks_catch_a_broken_layout(tmp_path):
    files = {
        "flows/ok.py": "from tasks.x import y\nimport infra.store\n",
        "tasks/ok.py": "from infra import store\n",
        "infra/bad.py": "def late():\n    from flows.cli import main\n",
        "infra/leak.py": "import dmd2.families.digits.data\n",
        "dmd2/bad.py": "from tasks import runtime\n",
        "dmd2/family.py": "FAMILIES = {'digits': 'dmd2.families.digits.family:DigitsFamily'}\n",
        "dmd2/families/digits/family.py": "from dmd2.families.digits.data import X\n",
        "dmd2/families/sd3/peek.py": "from dmd2.families.digits import data\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert layer_violations(tmp_path) == ["infra/bad.py imports flows.cli", "infra/bad.py imports flows.cli.main",
                                          "dmd2/bad.py imports tasks", "dmd2/bad.py imports tasks.runtime"]
    assert family_violations(tmp_path) == [
        "infra/leak.py imports dmd2.families.digits.data",
        "dmd2/families/sd3/peek.py imports dmd2.families.digits",
        "dmd2/families/sd3/peek.py imports dmd2.families.digits.data",
    ]


def unlisted_in_readme(root: Path) -> list[str]:
    """Every family folder and infra package that the README's layout section does not name."""
    readme = (root / "README.md").read_text()
    layout = readme[readme.index("## Layout"):].split("```")[1]
    folders = [p for p in sorted((root / "dmd2" / "families").iterdir()) if (p / "__init__.py").is_file()]
    folders += [p for p in sorted((root / "infra").iterdir()) if (p / "__init__.py").is_file()]
    return [name for name in (f"{p.relative_to(root).as_posix()}/" for p in folders) if name not in layout]


def test_the_readme_layout_names_every_family_and_infra_package():
    assert unlisted_in_readme(ROOT) == []


def test_the_readme_check_catches_a_new_family(tmp_path):
    (tmp_path / "README.md").write_text("## Layout\n\n```\ndmd2/families/digits/  x\ninfra/store/  y\n```\n")
    for package in ("dmd2/families/digits", "dmd2/families/wan", "infra/store", "infra/trainers"):
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
    assert unlisted_in_readme(tmp_path) == ["dmd2/families/wan/", "infra/trainers/"]
