"""Scheduled retraining's run ids (flows/series.py): the same teacher and training options continue
one run; a change of either starts a new run id from the template."""

import shutil
from datetime import date

import pytest

from dmd2.config import ConfigError
from flows.recipe import run_config
from flows.series import series_run_id, training_fingerprint
from infra.store import ArtifactStore
from tests.flows.conftest import write_recipe

DAY = date(2026, 12, 1)


@pytest.fixture
def setup(tmp_path, tiny_teacher_dir):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_teacher_dir, teacher)
    recipe = write_recipe(tmp_path / "tiny.toml", teacher, rollouts=2)
    return ArtifactStore((tmp_path / "store").as_uri()), recipe, teacher


def config_of(recipe, *overrides):
    return run_config(recipe, list(overrides))[0]


def test_the_same_training_continues_one_run_whatever_its_length_or_cadence(setup):
    store, recipe, _ = setup
    first = series_run_id(store, "tiny-{date}", config_of(recipe), DAY)
    assert first == "tiny-2026-12-01"
    later = config_of(recipe, "train.rollouts=9", "train.eval_interval=3", "eval.num_samples=20")
    assert series_run_id(store, "tiny-{date}", later, date(2026, 12, 5)) == first


def test_other_training_options_or_another_teacher_start_a_new_run(setup):
    store, recipe, teacher = setup
    first = series_run_id(store, "tiny-{date}", config_of(recipe), DAY)
    store.put_json(f"{first}/rollout-0/marker.json", {})  # the first run has started: its id is taken
    other_lr = series_run_id(store, "tiny-{date}", config_of(recipe, "optim.lr=3e-4"), DAY)
    assert other_lr == "tiny-2026-12-01-2"
    weights = next(teacher.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")  # a retrained teacher
    assert series_run_id(store, "tiny-{date}", config_of(recipe), date(2026, 12, 2)) == "tiny-2026-12-02"
    assert training_fingerprint(config_of(recipe)) != training_fingerprint(config_of(recipe, "optim.lr=3e-4"))


def test_a_template_without_a_date_is_refused(setup):
    store, recipe, _ = setup
    with pytest.raises(ConfigError, match=r"no \{date\} placeholder"):
        series_run_id(store, "nightly", config_of(recipe), DAY)
