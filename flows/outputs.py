"""A distill run's result: stored once in the artifact store, copied to the local outputs, shown in MLflow.

The result (`<run_id>/results/<rollouts>/result.json` in the store) is what a rerun of a finished run
reports instead of training again. Local outputs live in their own tree, `<output dir>/<run_id>/`:
the exported student (`student/`) and each evaluation picture (`<name>.png`) of the last evaluation.
"""

import dataclasses
import json
import re
import shutil
import tempfile
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dmd2.files import atomic_file
from infra.store import ArtifactRef, ArtifactStore
from infra.tracking import RunTracker


def artifact_key(name: str) -> str:
    """`name` as a Prefect artifact key (lowercase letters, digits and dashes)."""
    return re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")


RESULT_NAME = "result.json"


@dataclass(frozen=True)
class RunResult:
    """What a finished distill run produced; `student_dir` and `pictures` are filled locally."""

    run_id: str
    mlflow_run_id: str
    rollouts: int
    student: ArtifactRef
    eval: dict[str, float]
    media: ArtifactRef | None
    baselines: list[tuple[str, dict[str, float]]] | None
    student_dir: str = ""
    pictures: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["student"] = self.student.to_dict()
        data["media"] = self.media.to_dict() if self.media else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunResult":
        media = data["media"] and ArtifactRef.from_dict(data["media"])
        baselines = data["baselines"] and [(name, scores) for name, scores in data["baselines"]]
        return cls(**(data | {"student": ArtifactRef.from_dict(data["student"]), "media": media,
                              "baselines": baselines}))


def _result_key(run_id: str, rollouts: int) -> str:
    return f"{run_id}/results/{int(rollouts)}"


def save_result(store: ArtifactStore, result: RunResult) -> ArtifactRef:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / RESULT_NAME).write_text(json.dumps(result.to_dict(), indent=1, sort_keys=True))
        return store.put_dir(_result_key(result.run_id, result.rollouts), tmp)


def find_result(store: ArtifactStore, run_id: str, rollouts: int) -> RunResult | None:
    """The stored result of run `run_id` after `rollouts` rollouts, or None if it never finished them."""
    ref = store.find_dir(_result_key(run_id, rollouts))
    if ref is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        folder = store.get_dir(ref, Path(tmp) / "result")
        return RunResult.from_dict(json.loads((folder / RESULT_NAME).read_text()))


def write_outputs(store: ArtifactStore, result: RunResult, output_dir: Path, tracker: RunTracker,
                  new: bool) -> RunResult:
    """Copy the student and the pictures to `<output_dir>/<run_id>/`, and the student to MLflow: a `new`
    result always (a continued run replaces its student), a reported one only if MLflow lacks it."""
    local = output_dir / result.run_id
    student_dir = local / "student"
    fetch_dir(store, result.student, student_dir)
    pictures = {}
    if result.media is not None:
        for name, media in store.get_tensors(result.media).items():
            pictures[name] = str(save_media(media.numpy(), local, name))
    if new or not tracker.has_artifacts("student"):
        tracker.log_artifacts(student_dir, "student")
    return dataclasses.replace(result, student_dir=str(student_dir), pictures=pictures)


def fetch_dir(store: ArtifactStore, ref: ArtifactRef, dest: Path) -> None:
    """The stored directory `ref` at `dest`, replacing what is there (an older export of the run).

    A copy of the same ref (its manifest digest, kept beside it) is left as it is.
    """
    marker = dest.with_name(f".{dest.name}.ref.json")
    if dest.is_dir() and marker.is_file() and ArtifactRef.from_json(marker.read_text()) == ref:
        return
    fresh = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:12]}")
    store.get_dir(ref, fresh)
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:12]}")
        dest.rename(old)
        fresh.rename(dest)
        shutil.rmtree(old)
    else:
        fresh.rename(dest)
    with atomic_file(marker) as tmp:
        tmp.write_text(ref.to_json())


def save_media(media: np.ndarray, folder: Path, name: str) -> Path:
    """A picture as `<name>.png`; a video as `<name>.mp4` with the strip of its frames as `<name>.png` beside it.
    Returns the picture's or the video's path."""
    from dmd2.media import frame_strip, is_video

    if not is_video(media):
        return save_png(media, folder / f"{name}.png")
    from infra.tracking.video import write_mp4

    save_png(frame_strip(media), folder / f"{name}.png")
    with atomic_file(folder / f"{name}.mp4") as tmp:
        write_mp4(media, Path(tmp))
    return folder / f"{name}.mp4"


def save_png(pixels: np.ndarray, path: Path) -> Path:
    from PIL import Image

    with atomic_file(path) as tmp:
        Image.fromarray(pixels).save(tmp, format="PNG")
    return path
