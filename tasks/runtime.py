"""The live trainer groups of the runs this process drives, found by run id.

Prefect task parameters should be small and serialisable (they are shown in the UI and hashed), so
tasks take a run id and refs, and look the trainer groups (their rank workers) up here. The distill flow registers a
run's groups before its first rollout and removes them when it ends.
"""

from infra.trainers.stages import Groups

_GROUPS: dict[str, Groups] = {}


def register(run_id: str, groups: Groups) -> None:
    _GROUPS[run_id] = groups


def unregister(run_id: str) -> None:
    _GROUPS.pop(run_id, None)


def groups(run_id: str) -> Groups:
    try:
        return _GROUPS[run_id]
    except KeyError:
        raise LookupError(f"no trainer groups are registered for run {run_id!r} in this process: run the rollout "
                          "flow from the distill flow, which builds them") from None
