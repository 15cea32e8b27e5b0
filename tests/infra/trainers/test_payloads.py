"""Rank-to-rank payloads through the store (infra/trainers/payloads.py)."""

import pytest
import torch

from dmd2.scoring import Scores
from infra.trainers.payloads import get_record, put_record
from infra.store import ArtifactStore


def test_a_record_round_trips_as_its_own_type_at_the_rollout_key(tmp_path):
    store = ArtifactStore(f"file://{tmp_path}")
    scores = Scores(torch.arange(3), torch.rand(3), torch.randn(3, 1, 2, 2), torch.randn(3, 1, 2, 2))
    ref = put_record(store, "run", 4, "score", 1, scores)
    assert ref.uri.endswith("run/rollout-4/score/rank-1.safetensors")
    loaded = get_record(store, ref)
    assert type(loaded) is Scores
    assert all(torch.equal(getattr(loaded, f), getattr(scores, f)) for f in ("sample_index", "sigma", "x0_real", "x0_fake"))


def test_unknown_payload_types_are_refused(tmp_path):
    store = ArtifactStore(f"file://{tmp_path}")
    with pytest.raises(TypeError, match="a dict cannot travel between ranks"):
        put_record(store, "run", 0, "score", 0, {"x": torch.zeros(1)})
    ref = store.put_tensors("run/rollout-0/other/rank-0.safetensors", {"x": torch.zeros(1)})
    with pytest.raises(ValueError, match="holds no known record"):
        get_record(store, ref)
