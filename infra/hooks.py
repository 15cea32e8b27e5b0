"""Hooks by dotted path, resolved in one place.

A trainer group is a generic trainer (`dmd2.stages.train_steps`) plus four hooks named by dotted
paths such as ``"dmd2.stages.critic_loss_hook"``. Their signatures (also in `dmd2.stages`):

    train_input(ctx, pairs) -> pairs                         reshape the group's pairs before batching
    prepare(ctx, pairs, step) -> batch                       the pairs of optimizer step `step`
    loss(ctx, model, batch, step) -> (loss, metrics, keep)   one step's loss; `keep` feeds train_output
    train_output(ctx, kept) -> output                        no grad, after the steps; the group's output

`ctx` is a frozen `dmd2.stages.HookContext` (rollout-level: plan, DMD2 options, rank, the paired ranks'
`external_data`); per-step values are arguments and return values, never mutations of `ctx`. A
train_output must return None or a record of `infra.payloads.RECORD_TYPES` (it goes through the store).
"""

import importlib
from typing import Any, Callable

from dmd2.stages import Hooks
from infra.trainer_config import HookPaths


class HookError(ValueError):
    """A hook path that does not load; the message names the path and the option that set it."""


def load_function(path: str, option: str = "hook") -> Callable[..., Any]:
    """The callable at dotted path ``package.module.attr`` (``attr`` may be nested: ``mod.Cls.fn``).

    Raises `HookError` naming ``path`` and ``option`` when the module does not import, the attribute
    is missing, or the object is not callable.
    """
    if not isinstance(path, str) or "." not in path.strip("."):
        raise HookError(f"{option} = {path!r} is not a dotted path; write it as 'package.module.function'")
    parts = path.split(".")
    module, attrs = None, []
    # The longest importable prefix is the module; the rest are attributes (classes, functions).
    for cut in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:cut])
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
                continue  # this prefix is not a module: try a shorter one
            raise HookError(f"{option} = {path!r}: importing {name} failed: {exc}") from exc
        except Exception as exc:  # a module that exists but breaks on import
            raise HookError(f"{option} = {path!r}: importing {name} failed: {exc!r}") from exc
        attrs = parts[cut:]
        break
    if module is None:
        raise HookError(f"{option} = {path!r}: no module {parts[0]!r} is importable; check the spelling "
                        "and that the package is installed on every Ray node")
    obj: Any = module
    for attr in attrs:
        if not hasattr(obj, attr):
            raise HookError(f"{option} = {path!r}: {module.__name__} has no attribute "
                            f"{'.'.join(attrs)!r}; check the spelling")
        obj = getattr(obj, attr)
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
