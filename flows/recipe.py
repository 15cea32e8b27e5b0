"""A run's recipe as the distill flow and the CLI read it: the TOML file, `--set` overrides, the
rollout count, and the model family that will run it. Checked before any server starts."""

from pathlib import Path

from dmd2.config import ConfigError, DistillConfig, load_recipe, parse_overrides
from dmd2.family import ModelFamily, family_for

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
DEFAULT_RECIPE = RECIPES / "digits-4step.toml"


def run_config(recipe: str | Path, overrides: list[str] | None = None,
               rollouts: int | None = None) -> tuple[DistillConfig, ModelFamily]:
    """The validated config of a distill run and its family; `ConfigError` names what to change."""
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
    family = family_for(config.model)
    family.check(config)
    return config, family


def check_run_id(run_id: str) -> str:
    """A run id names one folder of the store: a safe name, not starting with "_" (the store's shared objects)."""
    from infra.store import validate_name

    try:
        validate_name(run_id, "--run-id")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if run_id.startswith("_"):
        raise ConfigError(f"--run-id {run_id!r} starts with '_', which names the store's shared objects; "
                          "choose another id")
    return run_id
