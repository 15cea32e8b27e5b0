"""Hooks by dotted path (infra/trainers/hooks.py)."""

import pytest

from dmd2 import hooks as dmd2_hooks
from dmd2 import plan, trainer
from infra.trainers.hooks import HookError, load_function, resolve_hooks
from infra.trainers.configs import ACTOR_HOOK_PATHS, CRITIC_HOOK_PATHS, HookPaths


def test_loads_functions_and_nested_attributes():
    assert load_function("dmd2.hooks.critic_loss_hook") is dmd2_hooks.critic_loss_hook
    assert load_function("dmd2.trainer.Hooks") is trainer.Hooks
    assert load_function("dmd2.plan.RolloutPlan.draws.fget") is plan.RolloutPlan.draws.fget


@pytest.mark.parametrize("path, reason", [
    ("no_such_package.hooks.loss", "no module 'no_such_package'"),
    ("dmd2.hooks.no_such_hook", "has no attribute 'no_such_hook'"),
    ("dmd2.no_such_module.loss", "has no attribute 'no_such_module'"),
    ("dmd2.hooks.CRITIC_HOOKS", "not a function"),
    ("critic_loss_hook", "not a dotted path"),
])
def test_a_path_that_does_not_load_is_an_error_naming_it(path, reason):
    with pytest.raises(HookError) as error:
        load_function(path, option="trainer 'critic' hooks.loss")
    assert path in str(error.value) and reason in str(error.value)
    assert "hooks.loss" in str(error.value)


def test_a_module_failing_on_import_is_reported_with_its_error(tmp_path, monkeypatch):
    (tmp_path / "broken_hooks.py").write_text("import no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(HookError, match="broken_hooks.loss.*no_such_dependency"):
        load_function("broken_hooks.loss")


def test_dmd2_hook_paths_resolve_to_the_stage_hooks():
    critic = resolve_hooks(CRITIC_HOOK_PATHS, "critic")
    assert critic == dmd2_hooks.CRITIC_HOOKS
    actor = resolve_hooks(ACTOR_HOOK_PATHS, "actor")
    assert (actor.loss, actor.prepare) == (dmd2_hooks.actor_loss_hook, dmd2_hooks.scored_pairs)


def test_unset_optional_hooks_keep_the_defaults_and_required_ones_are_named():
    hooks = resolve_hooks(HookPaths(loss="dmd2.hooks.critic_loss_hook", prepare="dmd2.hooks.critic_step_pairs"), "x")
    assert hooks.train_input("ctx", "pairs") == "pairs" and hooks.train_output("ctx", ["kept"]) is None
    with pytest.raises(HookError, match="trainer 'actor' has no loss/prepare hook"):
        resolve_hooks(HookPaths(), "actor")
    with pytest.raises(HookError, match="trainer 'critic' hooks.train_output = 'dmd2.hooks.nope'"):
        resolve_hooks(HookPaths(loss="dmd2.hooks.critic_loss_hook", prepare="dmd2.hooks.critic_step_pairs",
                                train_output="dmd2.hooks.nope"), "critic")
