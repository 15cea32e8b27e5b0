"""What every reliability test checks after its fault: the student is the uninterrupted run's, bit for bit,
and every MLflow step is there exactly once."""

import torch
from mlflow import MlflowClient

from dmd2.model import load_pretrained

STEP_KEYS = ("train/loss", "train/critic-loss", "time/rollout")


def assert_same_student(result: dict, uninterrupted: dict) -> None:
    expected = load_pretrained(uninterrupted["student_dir"]).state_dict()
    got = load_pretrained(result["student_dir"]).state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name


def assert_every_step_once(tracking_uri: str, result: dict, rollouts: int) -> None:
    client = MlflowClient(tracking_uri)
    for key in STEP_KEYS:
        steps = [m.step for m in client.get_metric_history(result["mlflow_run_id"], key)]
        assert sorted(steps) == list(range(rollouts)), key
