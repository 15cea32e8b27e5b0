"""Hooks by dotted path, resolved in one place.

A trainer group is a generic trainer (`dmd2.trainer.train_steps`) plus four hooks named by dotted
paths such as ``"dmd2.hooks.critic_loss_hook"``. Their signatures (also in `dmd2.trainer`):

    train_input(ctx, pairs) -> pairs                         reshape the group's pairs before batching
    prepare(ctx, pairs, step) -> batch                       the pairs of optimizer step `step`
    loss(ctx, model, batch, step) -> (loss, metrics, keep)   one step's loss; `keep` feeds train_output
    train_output(ctx, kept) -> output                        no grad, after the steps; the group's output

`ctx` is a frozen `dmd2.trainer.HookContext` (rollout-level: plan, DMD2 options, rank, the paired ranks'
`external_data`); per-step values are arguments and return values, never mutations of `ctx`. A
train_output must return None or a record of `infra.trainers.payloads.RECORD_TYPES` (it goes through the store).
"""

import pkgutil
from typing import Any, Callable

from dmd2.trainer import Hooks
from infra.trainers.configs import HookPaths


class HookError(ValueError):
    """A hook path that does not load; the message names the path and the option that set it."""


def load_function(path: str, option: str = "hook") -> Callable[..., Any]:
    """The callable at dotted path ``package.module.attr`` (``attr`` may be nested: ``mod.Cls.fn``),
    resolved by `pkgutil.resolve_name`.

    Raises `HookError` naming ``path`` and ``option`` when the module does not import, the attribute
    is missing, or the object is not callable.
    """
    if not isinstance(path, str) or "." not in path.strip("."):
        raise HookError(f"{option} = {path!r} is not a dotted path; write it as 'package.module.function'")
    try:
        obj = pkgutil.resolve_name(path)
    except ModuleNotFoundError as exc:
        if exc.name == path.split(".")[0]:
            raise HookError(f"{option} = {path!r}: no module {exc.name!r} is importable; check the spelling "
                            "and that the package is installed on every Ray node") from exc
        raise HookError(f"{option} = {path!r}: importing it failed: {exc}") from exc
    except AttributeError as exc:
        raise HookError(f"{option} = {path!r}: {exc}; check the spelling") from exc
    except Exception as exc:  # a module that exists but breaks on import
        raise HookError(f"{option} = {path!r}: importing it failed: {exc!r}") from exc
    if not callable(obj):
        raise HookError(f"{option} = {path!r} is a {type(obj).__name__}, not a function")
    return obj


def resolve_hooks(paths: HookPaths, role: str) -> Hooks:
    """A group's `Hooks` from its paths; unset optional hooks keep `Hooks`' defaults (identity, None)."""
    if paths.loss is None or paths.prepare is None:
        raise HookError(f"trainer {role!r} has no loss/prepare hook: set hooks.loss and hooks.prepare to "
                        "dotted paths (DMD2 sets them; other loss types need your own)")
    resolved: dict[str, Callable[..., Any]] = {}
    for name in ("loss", "prepare", "train_input", "train_output"):
        path = getattr(paths, name)
        if path is not None:
            resolved[name] = load_function(path, option=f"trainer {role!r} hooks.{name}")
    return Hooks(**resolved)
