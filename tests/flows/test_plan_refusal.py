"""`dmd2 distill` holds the run to its plan before anything starts: a recipe too large for this machine is refused
before any trainer group or MLflow run exists, and the rank processes started beside the plan end with it."""

import time

import pytest
import torch

from dmd2.config import ConfigError
from tests.reliability.faults import rank_pids
from tests.tracking_db import tracking_uri_in


def test_distill_refuses_a_recipe_too_large_for_this_machine_before_any_group_or_mlflow_run(prefect_server,
                                                                                            shared_ray, tmp_path):
    """A digits UNet of 2048 and 4096 channels (only its config.json: the plan reads no weights, and neither does
    the refusal) on CPU ranks: its state alone is larger than this machine's memory."""
    from diffusers import UNet2DModel
    from mlflow import MlflowClient

    from dmd2.families.digits.model import DIGITS_UNET_CONFIG
    from flows.distill import distill
    from tests.flows.conftest import write_recipe

    with torch.device("meta"):
        UNet2DModel(**DIGITS_UNET_CONFIG | {"block_out_channels": (2048, 4096), "norm_num_groups": 32}).save_config(
            tmp_path / "huge")
    recipe = write_recipe(tmp_path / "huge.toml", tmp_path / "huge", rollouts=2)
    tracking = tracking_uri_in(tmp_path)
    with pytest.raises(ConfigError, match=r"does not fit this machine's memory: its 1 CPU rank pair\(s\) need"):
        distill(recipe=str(recipe), run_id="huge", store_uri=(tmp_path / "store").as_uri(), tracking_uri=tracking,
                output_dir=str(tmp_path / "outputs"), cache_dir=str(tmp_path / "cache"))
    client = MlflowClient(tracking)
    experiment = client.get_experiment_by_name("dmd2")
    assert experiment is None or client.search_runs([experiment.experiment_id]) == []
    assert not (tmp_path / "store" / "huge" / "checkpoints").exists()
    # the rank processes started beside the plan (`start_ranks`) ended with the refusal
    deadline = time.monotonic() + 30
    while rank_pids():
        assert time.monotonic() < deadline, f"rank processes left after the refusal: {rank_pids()}"
        time.sleep(0.2)
