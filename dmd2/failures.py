"""Errors that stop a run for a reason the user can act on (stdlib only: the CLI catches them
without importing torch). Their message is the whole story: the CLI prints it without a traceback.

`NonFiniteError` is raised by every optimizer step whose loss or gradient norm is not finite, before
the step is applied, so no weight, optimizer state or checkpoint ever holds a NaN or an infinity.
"""


class RunError(RuntimeError):
    """A run stopped; the message names where, why, what was kept, and what to change."""


class NonFiniteError(RunError, FloatingPointError):
    """A loss, gradient norm or stored tensor is NaN or infinite; nothing was stepped or written."""
