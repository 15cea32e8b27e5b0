"""Where a recipe's models are ([model] teacher, student, critic_load; [eval] clip_model), checked before
anything heavy loads.

A model spec is a local directory, which must exist and be readable, or a Hugging Face hub id
(`owner/name`), which cannot be checked offline beyond its syntax; with HF_HUB_OFFLINE=1 it must be
in the local hub cache already, since nothing will fetch it. Either way `model_dir` finds the
directory a family's checks then read (model_index.json, config.json) to tell whether it is the right
kind of model. Standard library only (and huggingface_hub's `constants`, which imports nothing heavy,
for the cache's place), so the CLI refuses a missing teacher in a fraction of a second.
"""

import os
import re
from pathlib import Path

from dmd2.config import ConfigError

# The hub's rule for a model repo id (huggingface_hub.utils.validate_repo_id, which takes 0.2 s to import):
# owner/name, each of [A-Za-z0-9._-] not starting or ending with '.' or '-', no '--' or '..', 96 at most.
_HUB_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?"
HUB_ID = re.compile(rf"{_HUB_PART}/{_HUB_PART}")


def is_hub_id(spec: str) -> bool:
    """Whether `spec` reads as a hub id `owner/name` (whether the hub has it is not checked)."""
    return len(spec) <= 96 and HUB_ID.fullmatch(spec) is not None and "--" not in spec and ".." not in spec


def model_dir(option: str, spec: str) -> Path | None:
    """The local directory of model spec `spec`, checked to be a readable directory: `spec` itself, or for a
    hub id its snapshot in the local hub cache; None for a hub id not cached (the family fetches it later).

    `option` names the spec in the `ConfigError`s, e.g. "[model] teacher".
    """
    path = Path(spec)
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{option} = {spec!r} is a file; give the model's directory (save_pretrained: the "
                              "folder holding its config.json or model_index.json)")
        if not os.access(path, os.R_OK | os.X_OK):
            raise ConfigError(f"{option} = {spec!r} cannot be read by this user; fix its permissions "
                              f"(chmod -R a+rX {spec}) or copy it somewhere readable")
        return path
    if not is_hub_id(spec):
        raise ConfigError(f"{option} = {spec!r} does not exist; give a model directory (save_pretrained) or a "
                          "Hugging Face hub id (owner/name)")
    return _cached_snapshot(option, spec)


def _cached_snapshot(option: str, repo_id: str) -> Path | None:
    """The hub cache's snapshot of `repo_id` (its `main` ref, else the newest), or None if it has none;
    under HF_HUB_OFFLINE=1 a missing one is refused, as nothing could fetch it."""
    from huggingface_hub import constants  # light: settings only, read from the environment

    repo = Path(constants.HF_HUB_CACHE) / f"models{constants.REPO_ID_SEPARATOR}" \
        f"{repo_id.replace('/', constants.REPO_ID_SEPARATOR)}"
    snapshots = repo / "snapshots"
    main = repo / "refs" / "main"
    if main.is_file() and (snapshots / main.read_text().strip()).is_dir():
        return snapshots / main.read_text().strip()
    cached = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
    if cached:
        return cached[-1]
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"{option} = {repo_id!r} is a hub id that is not in the local Hugging Face cache "
                          f"({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE is set, so nothing can fetch it: "
                          f"download it first (hf download {repo_id}), unset HF_HUB_OFFLINE, or give a local "
                          "directory")
    return None
