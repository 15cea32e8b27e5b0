"""A run's recipe as the distill flow and the CLI read it: the TOML file, `--set` overrides, the
rollout count, the model family that will run it, and the run id. Checked before any server starts.

`checked_config` and `check_run_id` import nothing heavy (no torch, no family's models), so the CLI
refuses a bad recipe in a fraction of a second (flows/preflight.py); `run_config` is the same check,
then the family itself.
"""

import re
from pathlib import Path
from typing import TYPE_CHECKING

from dmd2.config import ConfigError, DistillConfig, load_recipe, parse_overrides
from dmd2.family import ModelFamily, checked_family, family_class

if TYPE_CHECKING:  # infra.store loads torch, which a bad recipe must not cost
    from infra.store import Checkpoint

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
DEFAULT_RECIPE = RECIPES / "digits-4step.toml"
# The store's rule for a name, such as a run id (infra.store.keys.validate_name), repeated here because
# importing infra.store loads torch and a bad run id must cost nothing; tests/reliability/test_bad_input.py
# checks that the two rules agree.
STORE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")


def checked_config(recipe: str | Path, overrides: list[str] | None = None,
                   rollouts: int | None = None) -> tuple[DistillConfig, str]:
    """The validated config of a distill run and the name of its family, whose checks it passed;
    `ConfigError` names what to change."""
    if rollouts is not None and rollouts < 1:
        raise ConfigError(f"--rollouts must be >= 1, got {rollouts}")
    if not Path(recipe).is_file():
        raise ConfigError(f"--recipe {recipe} does not exist (recipes are in {RECIPES})")
    parsed = parse_overrides(overrides or [])
    if rollouts is not None:
        parsed.setdefault("train", {})["rollouts"] = rollouts
    config = load_recipe(recipe, parsed)
    if config.train.loss_type != "dmd2":
        raise ConfigError(f"[train] loss_type = {config.train.loss_type!r}: the distill flow runs DMD2 rollouts "
                          "only; set loss_type = 'dmd2'")
    return config, checked_family(config)


def run_config(recipe: str | Path, overrides: list[str] | None = None,
               rollouts: int | None = None) -> tuple[DistillConfig, ModelFamily]:
    """The validated config of a distill run and its family; `ConfigError` names what to change."""
    config, family = checked_config(recipe, overrides, rollouts)
    return config, family_class(family)()


def check_run_id(run_id: str) -> str:
    """A run id names one folder of the store: a safe name, not starting with "_" (the store's shared objects)."""
    if not isinstance(run_id, str) or not STORE_NAME.fullmatch(run_id):
        raise ConfigError(f"invalid --run-id {run_id!r:.200}: use 1-255 characters from [A-Za-z0-9._-], not "
                          "starting with '.' or '-' (no '/', '..', absolute paths or URI schemes)")
    if run_id.startswith("_"):
        raise ConfigError(f"--run-id {run_id!r} starts with '_', which names the store's shared objects; "
                          "choose another id")
    return run_id


def check_rollouts_reach(run_id: str, latest: "Checkpoint | None", rollouts: int) -> None:
    """A run is continued, never cut back: `ConfigError` unless `rollouts` reaches the step of its newest checkpoint
    `latest` (None: it has none yet)."""
    if latest is not None and latest.step > rollouts:
        raise ConfigError(f"run {run_id} already has {latest.step} rollouts; pass rollouts >= {latest.step} to "
                          "continue it, or use a new run id")
