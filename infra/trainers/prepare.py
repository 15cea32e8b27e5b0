"""A family's once-per-run inputs (e.g. the encoded prompts), made on Ray workers and shared by runs.

The driver names them by the family's `prepared_key` (a digest of their inputs' contents). When the
store already holds `_shared/prepared/<key>` it is reused; otherwise Ray tasks (not a trainer group: what
they load, e.g. the text encoders, is gone when they return) make and store them: one, or with `[data]
prepare_workers` (default: one per GPU of the cluster) that many at once, each encoding a part of the prompts on a
GPU of its own, and one more task merging the parts into the table one worker would make (`merge_prepared`) and
storing it. Ranks read them back with `load_prepared` and hand them to the family's `bind`: mapped from one copy
per node (a table of every prompt's embeddings is ~5 MB a prompt for SD3; eight private copies of 10,000 prompts
would be ~430 GB of a node's memory).
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


def _make_part(family: ModelFamily, config: DistillConfig, part: tuple[int, int]) -> dict[str, dict[str, torch.Tensor]]:
    return family.prepare(config, part)  # a Ray task of its own: its text encoders are gone when it returns


def store_prepared(family: ModelFamily, config: DistillConfig, store: ArtifactStore, key: str,
                   parts: list | None = None) -> ArtifactRef:
    """Make the prepared inputs (or merge the ``parts`` other tasks made: a list of Ray object refs, fetched here)
    and store them at ``key``."""
    tables = family.prepare(config) if parts is None else family.merge_prepared(ray.get(parts))
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
    gpus = int(ray.cluster_resources().get("GPU", 0))
    per_task = {"num_cpus": 1, "num_gpus": 1 if gpus else 0}
    workers = config.data.prepare_workers or max(gpus, 1)
    make_and_store = ray.remote(store_prepared)
    if workers == 1:
        ref = ray.get(make_and_store.options(**per_task).remote(family, config, store, key))
    else:
        logger.info("preparing the inputs on %d workers, each a part of the prompts", workers)
        part = ray.remote(_make_part).options(**per_task)
        parts = [part.remote(family, config, (index, workers)) for index in range(workers)]
        ref = ray.get(make_and_store.options(num_cpus=1).remote(family, config, store, key, parts))
    logger.info("prepared %s", ref.uri)
    return ref, True


def load_prepared(store: ArtifactStore, ref: ArtifactRef | None,
                  cache_dir: str | Path) -> dict[str, dict[str, torch.Tensor]]:
    """The prepared tables by name (empty without any), read-only tensors mapped from their files in
    ``<cache_dir>/prepared/<digest>``, which every process of the node shares: the first to need them downloads
    them (verified, and renamed into place whole), the others and later runs map the same files. So a node holds
    one copy in its page cache whatever its number of ranks, and a rank reads the rows its batches index."""
    if ref is None:
        return {}
    folder = Path(cache_dir) / "prepared" / ref.sha256[:32]  # named by the manifest's digest: by the contents
    if not folder.is_dir():
        try:
            store.get_dir(ref, folder)
        except OSError:
            if not folder.is_dir():
                raise
            logger.info("%s was stored by another process of this node meanwhile", folder)
    return {path.stem: load_file(str(path)) for path in sorted(folder.glob("*.safetensors"))}
