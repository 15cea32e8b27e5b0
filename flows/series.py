"""Scheduled retraining: which run a scheduled distill flow run trains.

A scheduled deployment names a run id template (``digits-nightly-{date}``) instead of a run id. Each
run of the series has a fingerprint: the teacher's digest and the recipe's training options (every
option but those that only say how long, how often to save or evaluate, and where to run). A
scheduled flow run continues the series' run of the same fingerprint; when the teacher or the
training options changed, no run has that fingerprint and a new run id is made from the template
(with today's date; ``-2``, ``-3``... if that id is taken). The store keeps one small JSON object per
fingerprint, ``_series/<template name>/<fingerprint>.json``, naming its run.
"""

import hashlib
import json
from datetime import date
from pathlib import Path

from dmd2.config import ConfigError, DistillConfig, config_to_dict
from flows.recipe import check_run_id
from infra.store import ArtifactStore
from infra.store.io import file_sha256

SERIES_PREFIX = "_series"
# What a scheduled run may change without starting a new run: its length, cadence and placement.
NOT_TRAINING = {"train": ("rollouts", "save_interval", "eval_interval", "keep_rollouts"), "eval": None, "cluster": None,
                "registry": None}


def teacher_digest(teacher: str) -> str:
    """sha256 over the teacher directory's files (names and contents), or of a hub id as given."""
    root = Path(teacher)
    if not root.is_dir():
        return hashlib.sha256(teacher.encode()).hexdigest()
    digest = hashlib.sha256()
    # Each file's piece-wise digest, the one the series' stored fingerprints were made with: another would
    # make every existing series see a new teacher and start a new run.
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(root).as_posix()}\0{file_sha256(path, legacy=True)}\0".encode())
    return digest.hexdigest()


def training_fingerprint(config: DistillConfig) -> str:
    """What a run trains: the teacher's digest and every option that changes the training."""
    options = config_to_dict(config)
    for section, keys in NOT_TRAINING.items():
        if keys is None:
            options.pop(section, None)
        else:
            for key in keys:
                options.get(section, {}).pop(key, None)
    options["model"] = dict(options["model"], teacher=teacher_digest(config.model.teacher))
    return hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:16]


def template_name(template: str) -> str:
    """The series' folder name: the template with its placeholder dropped (``digits-nightly-{date}`` -> ``digits-nightly``)."""
    if "{date}" not in template:
        raise ConfigError(f"run_id_template {template!r} has no {{date}} placeholder, e.g. 'digits-nightly-{{date}}'")
    name = template.replace("{date}", "").strip("-_.") or "series"
    return check_run_id(name)


def series_run_id(store: ArtifactStore, template: str, config: DistillConfig, today: date | None = None) -> str:
    """The run a scheduled flow run trains: the series' run of this fingerprint, or a new one."""
    key = f"{SERIES_PREFIX}/{template_name(template)}/{training_fingerprint(config)}.json"
    known = store.find_json(key)
    if known is not None:
        return known["run_id"]
    base = check_run_id(template.format(date=(today or date.today()).isoformat()))
    run_id, n = base, 1
    while store.latest_checkpoint(run_id) is not None or store.list_rollouts(run_id):
        n += 1
        run_id = f"{base}-{n}"
    store.put_json(key, {"run_id": run_id, "template": template})
    return run_id
