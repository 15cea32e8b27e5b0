"""Bad SD3 input is refused before Prefect, Ray or MLflow start, naming the option and the fix."""

import re

import pytest

from flows.cli import main
from flows.recipe import RECIPES
from tests.dmd2.families.sd3.tiny_pipeline import build_tiny_sd3_pipeline, build_tiny_sd_pipeline


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipelines")
    prompts = tmp / "prompts.txt"
    prompts.write_text("a photo of a cat\n")
    (tmp / "empty.txt").write_text("\n\n")
    (tmp / "neither").mkdir()
    return {"sd3": build_tiny_sd3_pipeline(tmp / "sd3"), "sd": build_tiny_sd_pipeline(tmp / "sd"), "tmp": tmp,
            "prompts": prompts}


@pytest.mark.parametrize("teacher, prompts, extra, message", [
    ("sd", "prompts", [], r"is 'DDPMScheduler'; DMD2 on SD3 needs a flow-matching teacher"),
    ("sd3", "prompts", ["data.resolution=18"], r"\[data\] resolution 18 is not a multiple of 4 .*use 16 or 20"),
    ("sd3", "missing", [], r"\[data\] prompts .*missing.txt: does not exist"),
    ("sd3", "empty", [], r"\[data\] prompts .*empty.txt: holds no prompt"),
    ("neither", "prompts", [], r"\[model\] teacher = .*neither.* is neither a model nor a pipeline"),
])
def test_bad_sd3_input_is_refused_before_any_server(pipelines, teacher, prompts, extra, message, tmp_path,
                                                    monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    tmp = pipelines["tmp"]
    teacher_dir = pipelines.get(teacher, tmp / teacher)
    prompt_file = pipelines["prompts"] if prompts == "prompts" else tmp / f"{prompts}.txt"
    overrides = [f"model.teacher={teacher_dir}", f"data.prompts={prompt_file}", *extra]
    argv = ["distill", "--recipe", str(RECIPES / "sd35-medium-4step.toml")]
    assert main(argv + [item for o in overrides for item in ("--set", o)]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []  # no MLflow database, no store, no outputs
