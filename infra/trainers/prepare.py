"""A family's once-per-run inputs (e.g. the encoded prompts), made on a Ray worker and shared by runs.

The driver names them by the family's `prepared_key` (a digest of their inputs' contents). When the
store already holds `_shared/prepared/<key>` it is reused; otherwise one Ray task (not a trainer
group: what it loads, e.g. the text encoders, is gone when it returns) makes and stores them. Ranks
read them back with `load_prepared` and hand them to the family's `bind`.
"""

import logging
import tempfile
from pathlib import Path

import ray
import torch
from safetensors.torch import load_file, save_file

from dmd2.config import DistillConfig
from dmd2.family import ModelFamily
from infra.store import ArtifactRef, ArtifactStore

logger = logging.getLogger(__name__)

PREPARED_PREFIX = "_shared/prepared"  # run ids cannot start with "_": no run's folder can collide


def _make_and_store(family: ModelFamily, config: DistillConfig, store: ArtifactStore, key: str) -> ArtifactRef:
    tables = family.prepare(config)
    with tempfile.TemporaryDirectory() as tmp:
        for name, tensors in tables.items():
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(Path(tmp) / f"{name}.safetensors"))
        return store.put_dir(f"{PREPARED_PREFIX}/{key}", tmp)


def prepare_inputs(family: ModelFamily, config: DistillConfig, store: ArtifactStore) -> tuple[ArtifactRef | None, bool]:
    """(The ref of the family's prepared inputs or None if it needs none, whether they were made now)."""
    key = family.prepared_key(config)
    if key is None:
        return None, False
    found = store.find_dir(f"{PREPARED_PREFIX}/{key}")
    if found is not None:
        logger.info("reusing the prepared inputs %s", found.uri)
        return found, False
    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    ref = ray.get(ray.remote(_make_and_store).options(num_cpus=1, num_gpus=gpus).remote(family, config, store, key))
    logger.info("prepared %s", ref.uri)
    return ref, True


def load_prepared(store: ArtifactStore, ref: ArtifactRef | None) -> dict[str, dict[str, torch.Tensor]]:
    """The prepared tables by name (empty without any)."""
    if ref is None:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = store.get_dir(ref, Path(tmp) / "prepared")
        return {path.stem: {k: v.clone() for k, v in load_file(str(path)).items()}
                for path in sorted(folder.glob("*.safetensors"))}
