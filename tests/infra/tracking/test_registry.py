"""The student as a registered MLflow model, on real MLflow (sqlite, artifacts under the test's folder)."""

import math

import mlflow
import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from dmd2.config import config_from_dict
from dmd2.family import family_class
from dmd2.families.digits.model import build_digits_unet
from infra.tracking import CHAMPION, LATEST_URI, RunTracker, register_student
from infra.tracking.registry import PROMOTION_TAG, promotion

GATE = "eval/fd_teacher"


@pytest.fixture(scope="module")
def tracking(tmp_path_factory):
    """One sqlite store for the module (each test its own registered model); `models:/` URIs resolve to it."""
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as env:
        env.chdir(root)  # MLflow puts a sqlite store's artifacts under ./mlruns
        env.setenv("MLFLOW_TRACKING_URI", uri)
        yield uri


@pytest.fixture(scope="module")
def digits():
    return family_class("digits")()


@pytest.fixture(scope="module")
def student(tmp_path_factory, digits):
    """A tiny digits student exported by its family, and its generation settings (2 steps)."""
    config = config_from_dict({"model": {"teacher": "builtin:digits"}, "student": {"num_steps": 2}})
    torch.manual_seed(0)
    out_dir = tmp_path_factory.mktemp("outputs") / "student"
    digits.export(build_digits_unet(block_out_channels=(8, 16), norm_num_groups=4), config, out_dir,
                  {"run_id": "r", "rollouts": 1, "scores": {}})
    return out_dir, digits.generation_settings(config)


def register(tracking, student, family, name, scores, n):
    """Register the export as if it were the n-th export of a distill run (its own store URI)."""
    tracker = RunTracker.start_or_resume(f"{name}-run", uri=tracking)
    student_dir, settings = student
    return register_student(tracker.client, name, tracker.mlflow_run_id, student_dir, family, settings, scores,
                            student_uri=f"file:///store/{name}-run/student/{n}", flow_run_id=f"flow-{n}", step=n)


def test_the_registered_model_generates_the_families_pixels(tracking, student, digits):
    registered = register(tracking, student, digits, "pixels", {GATE: 3.0}, 1)
    model = mlflow.pyfunc.load_model(f"models:/pixels@{CHAMPION}")
    labels = [3, 1, 4, 1, 5]
    images = model.predict(labels)
    assert images.dtype == np.uint8 and images.shape == (5, 8, 8)
    np.testing.assert_array_equal(images, np.stack(digits.generate(student[0], labels, student[1], seed=0)))
    np.testing.assert_array_equal(model.predict(np.array(labels), params={"seed": 9}),
                                  np.stack(digits.generate(student[0], labels, student[1], seed=9)))
    assert not np.array_equal(model.predict(labels, params={"seed": 9}), images)
    assert images[0].std() > 0  # pictures, not a constant
    assert model.metadata.get_input_schema().input_types() == [mlflow.types.DataType.long]
    assert model.metadata.get_output_schema().inputs[0].shape == (-1, 8, 8)
    assert model.metadata.load_input_example(mlflow.artifacts.download_artifacts(registered.model_uri)) is not None
    with pytest.raises(Exception, match="class labels must lie in 0..9"):
        model.predict([10])


def latest_model_id(name):
    return mlflow.models.get_model_info(LATEST_URI.format(name=name)).model_id


def test_champion_moves_only_to_a_better_gate_figure_and_latest_always(tracking, student, digits):
    versions = [register(tracking, student, digits, "gate", {GATE: figure}, n) for n, figure in
                enumerate([5.0, 4.0, 4.5], start=1)]
    assert [v.promoted for v in versions] == [True, True, False]
    client = MlflowClient(tracking)
    assert str(client.get_model_version_by_alias("gate", CHAMPION).version) == versions[1].version == "2"
    assert latest_model_id("gate") == versions[2].model_id
    tags = [MlflowClient(tracking).get_model_version("gate", v.version).tags[PROMOTION_TAG] for v in versions]
    assert tags == [v.reason for v in versions]
    assert tags[1] == f"champion: {GATE} 4 < 5 of version 1, the previous champion"
    assert tags[2] == f"not promoted: {GATE} 4.5 >= 4 of version 2, the champion"


def test_a_version_without_a_finite_gate_figure_is_never_champion(tracking, student, digits):
    skipped = register(tracking, student, digits, "finite", {}, 1)  # evaluation skipped: no scores at all
    failed = register(tracking, student, digits, "finite", {GATE: math.nan, "eval/accuracy": 0.5}, 2)
    assert not skipped.promoted and skipped.reason == f"not promoted: no {GATE} (evaluation skipped or failed)"
    assert not failed.promoted and failed.reason == f"not promoted: {GATE} is nan"
    client = MlflowClient(tracking)
    assert CHAMPION not in client.get_registered_model("finite").aliases
    first = register(tracking, student, digits, "finite", {GATE: 9.0}, 3)
    inf = register(tracking, student, digits, "finite", {GATE: math.inf}, 4)
    assert first.promoted and not inf.promoted
    assert str(client.get_model_version_by_alias("finite", CHAMPION).version) == first.version
    assert latest_model_id("finite") == inf.model_id


def test_version_tags_hold_the_runs_the_store_uri_and_the_figures(tracking, student, digits):
    scores = {GATE: 4.25, "eval/fd_real": 7.5, "eval/accuracy": 0.875}
    registered = register(tracking, student, digits, "tags", scores, 1)
    client = MlflowClient(tracking)
    version = client.get_model_version("tags", registered.version)
    run_id = RunTracker.start_or_resume("tags-run", uri=tracking).mlflow_run_id
    assert version.run_id == run_id and version.tags["dmd2.mlflow_run_id"] == run_id
    assert version.tags["prefect.flow_run_id"] == "flow-1"
    assert version.tags["dmd2.student"] == "file:///store/tags-run/student/1"
    assert {key: float(version.tags[key]) for key in scores} == scores
    assert client.get_run(run_id).data.tags["dmd2.model_version"] == "tags/1"
    assert client.get_logged_model(registered.model_id).source_run_id == run_id


def test_registering_the_same_export_again_returns_its_version(tracking, student, digits):
    first = register(tracking, student, digits, "again", {GATE: 2.0}, 1)
    second = register(tracking, student, digits, "again", {GATE: 3.0}, 2)
    again = register(tracking, student, digits, "again", {GATE: 2.0}, 1)  # a retried flow run
    assert again == first
    assert len(MlflowClient(tracking).search_model_versions("name = 'again'")) == 2
    assert latest_model_id("again") == second.model_id


@pytest.mark.parametrize("figure, champion, promoted", [
    (0.9, ("1", 0.8), True), (0.8, ("1", 0.8), False), (0.7, ("1", 0.8), False), (0.1, None, True),
    (0.1, ("1", None), True)])
def test_promotion_when_higher_is_better(figure, champion, promoted):
    assert promotion("eval/clip_score", False, figure, champion)[0] is promoted


@pytest.mark.parametrize("figure, error, champion_error, promoted", [
    (0.010, 0.002, 0.002, False),  # 0.005 better, within 2 x 0.0028
    (0.009, 0.002, 0.002, True),  # 0.006 better, beyond 2 x 0.0028
    (0.014, 0.0001, 0.0001, True), (0.010, 0.002, None, True), (0.010, None, 0.002, True),  # no noise to weigh
    (0.016, 0.0001, 0.0001, False)])
def test_a_better_figure_within_two_standard_errors_keeps_the_champion(figure, error, champion_error, promoted):
    decision, reason = promotion("eval/distance_teacher", True, figure, ("1", 0.015), error=error,
                                 champion_error=champion_error)
    assert decision is promoted
    assert ("within 2 standard errors" in reason) is (not promoted and figure < 0.015)


def test_a_family_without_a_gate_metric_promotes_nothing():
    assert promotion(None, True, 1.0, None) == (False, "not promoted: the family names no gate metric")


@pytest.fixture(scope="module")
def sd3_teacher(tmp_path_factory):
    from tests.dmd2.families.sd3.tiny_pipeline import build_tiny_sd3_pipeline

    return build_tiny_sd3_pipeline(tmp_path_factory.mktemp("sd3") / "teacher")


@pytest.fixture(scope="module")
def sd3_student(sd3_teacher, tmp_path_factory):
    """A tiny SD3 student exported by its family, and its generation settings (2 steps, 16 px)."""
    from dmd2.families.sd3.export import export_pipeline
    from dmd2.families.sd3.pipeline import load_transformer

    out_dir = tmp_path_factory.mktemp("sd3-outputs") / "student"
    return export_pipeline(sd3_teacher, load_transformer(sd3_teacher), 2, 3.0, out_dir, {}), {"num_steps": 2,
                                                                                             "resolution": 16}


def test_an_sd3_student_is_a_model_of_prompts(tracking, sd3_student, monkeypatch):
    student_dir, settings = sd3_student
    sd3 = family_class("sd3")()
    tracker = RunTracker.start_or_resume("sd3-run", uri=tracking)
    with monkeypatch.context() as patch:  # logging copies the export, it never loads it (GBs, on the driver)
        patch.setattr(type(sd3), "student_generator", lambda *args: pytest.fail("logging loaded the student"))
        registered = register_student(tracker.client, "sd3", tracker.mlflow_run_id, student_dir, sd3, settings,
                                      {sd3.gate_metric: 0.25}, student_uri="s3://b/sd3-run/student/2",
                                      flow_run_id="f")
    assert registered.promoted
    model = mlflow.pyfunc.load_model(f"models:/sd3@{CHAMPION}")
    prompts = ["a photo of a cat", "a red dog"]
    images = model.predict(prompts, params={"seed": 1})
    assert images.dtype == np.uint8 and images.shape == (2, 16, 16, 3)
    np.testing.assert_array_equal(images, np.stack(sd3.generate(student_dir, prompts, settings, seed=1)))


def test_the_champion_moves_only_beyond_both_versions_noise_read_from_their_tags(tracking, sd3_student):
    """The gate's standard error (`eval/distance_teacher_se`, as the evaluation logs it) travels in each version's
    tags: a better figure within 2 standard errors of the champion's keeps the champion, one beyond moves it."""
    sd3, gate = family_class("sd3")(), "eval/distance_teacher"
    figures = [(0.020, 0.004), (0.012, 0.003), (0.004, 0.001)]  # 0.008 < 2 x 0.005 better; then 0.016 > 2 x 0.0041
    versions = [register(tracking, sd3_student, sd3, "noisy", {gate: kid, f"{gate}_se": error}, n)
                for n, (kid, error) in enumerate(figures, start=1)]
    assert [v.promoted for v in versions] == [True, False, True]
    assert versions[1].reason == (f"not promoted: {gate} 0.012 ± 0.003 < 0.02 ± 0.004 of version 1, the champion, "
                                  "but within 2 standard errors")
    assert str(MlflowClient(tracking).get_model_version_by_alias("noisy", CHAMPION).version) == versions[2].version


def test_a_collapsed_sd3_student_is_not_promoted_over_a_healthy_champion(tracking, sd3_teacher, sd3_student,
                                                                          tmp_path):
    """A student that draws the same picture from every noise (tests/dmd2/families/sd3/collapse.py) scores a worse
    distance to the teacher than a healthy one, so the SD3 family's gate keeps the healthy champion."""
    from diffusers import StableDiffusion3Pipeline

    from tests.dmd2.families.sd3.collapse import healthy_and_collapsed

    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_teacher, low_cpu_mem_usage=False)
    healthy, collapsed = healthy_and_collapsed(sd3_teacher, pipe, tmp_path)
    assert collapsed.scores["eval/diversity_ratio"] < 0.01
    sd3 = family_class("sd3")()
    versions = [register(tracking, sd3_student, sd3, "collapse", evaluation.scores, n)
                for n, evaluation in enumerate([healthy, collapsed], start=1)]
    assert [v.promoted for v in versions] == [True, False]
    assert versions[1].reason.startswith(f"not promoted: {sd3.gate_metric} ")
    assert str(MlflowClient(tracking).get_model_version_by_alias("collapse", CHAMPION).version) == versions[0].version
