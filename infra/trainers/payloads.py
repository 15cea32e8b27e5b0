"""Rank-to-rank payloads through the artifact store: records in, `ArtifactRef`s out.

A stage's per-rank result (rollout samples, train pairs, what the critic kept, scores) is written by
the rank that made it and read by the rank that needs it; the driver only ever holds the refs.
A payload is a safetensors object holding the record's tensors (`dmd2.tensors.to_tensor_dict`) plus a
``__record__`` entry naming its type, so the reader needs no side channel. Only the record types in
`RECORD_TYPES` are ever rebuilt: a stored name never makes a reader import anything.
"""

import torch

from dmd2.convert import TrainPairs
from dmd2.critic import ScoringInputs
from dmd2.failures import NonFiniteError
from dmd2.rollout import RolloutSamples
from dmd2.scoring import Scores
from dmd2.tensors import from_tensor_dict, non_finite, to_device, to_tensor_dict
from infra.store import ArtifactRef, ArtifactStore

RECORD_TYPES: dict[str, type] = {cls.__name__: cls for cls in (RolloutSamples, TrainPairs, ScoringInputs, Scores)}
RECORD_KEY = "__record__"


def put_record(store: ArtifactStore, run_id: str, rollout_id: int, task: str, rank: int, record: object) -> ArtifactRef:
    """Store ``record`` at ``<run_id>/rollout-<n>/<task>/rank-<r>.safetensors``; return its ref.

    A record holding a NaN or an infinity is refused (`NonFiniteError`): nothing non-finite is stored,
    and a model whose outputs overflow stops the run where they first do."""
    name = type(record).__name__
    if RECORD_TYPES.get(name) is not type(record):
        raise TypeError(f"{task}: a {name} cannot travel between ranks; return one of {sorted(RECORD_TYPES)} "
                        "(or add the dataclass to infra.trainers.payloads.RECORD_TYPES)")
    tensors = {name: tensor.cpu() for name, tensor in to_tensor_dict(record).items()}  # once per stage
    problem = non_finite(tensors.items())
    if problem:
        raise NonFiniteError(f"rollout {rollout_id}, the {task} output of rank {rank} was not stored: {problem}; "
                             "the model's outputs overflowed (lower [optim] lr / critic_lr, or raise [optim] "
                             "warmup_steps); the run's last checkpoint (if any) stays its latest")
    tensors[RECORD_KEY] = torch.frombuffer(bytearray(name.encode()), dtype=torch.uint8)
    # Not fsynced: after a machine crash the run resumes from its last checkpoint and makes them again.
    return store.put_tensors(store.rollout_key(run_id, rollout_id, task, rank), tensors, durable=False)


def get_record(store: ArtifactStore, ref: ArtifactRef, device: torch.device | str = "cpu") -> object:
    """The record stored at ``ref`` (its sha256 verified by the store), rebuilt as its own type on
    ``device`` (the rank's: a stage moves its inputs once, `dmd2.tensors.to_device`)."""
    tensors = dict(store.get_tensors(ref))
    marker = tensors.pop(RECORD_KEY, None)
    name = bytes(marker.tolist()).decode() if marker is not None else None
    if name not in RECORD_TYPES:
        raise ValueError(f"{ref.uri} holds no known record (found {name!r}); expected one of {sorted(RECORD_TYPES)}")
    # Copies: hooks may write in place, and a record must not alias the store's read buffer.
    return to_device(from_tensor_dict(RECORD_TYPES[name], {k: v.clone() for k, v in tensors.items()}), device)
