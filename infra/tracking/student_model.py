"""The exported student as an MLflow model: a pyfunc whose artifact is the export and whose `predict`
is its family's generation (`ModelFamily.student_generator`).

`mlflow.diffusers` (MLflow 3.x) logs LoRA adapters over a hub base model only; a DMD2 student is a
whole model (a digits UNet2DModel directory, a complete SD3 pipeline), so it is a custom pyfunc here.
The model is logged as a LoggedModel of the distill run through the run's own client (no fluent
state: no global tracking URI, no active run), with an explicit signature, input example and pip
requirements, so logging neither infers dependencies nor runs the model.

    model = mlflow.pyfunc.load_model("models:/<name>@champion")
    model.predict([3, 1, 4])                        # digits: uint8 [3, 8, 8]
    model.predict(["a cat"], params={"seed": 7})    # sd3: uint8 [1, H, W, 3]
"""

import shutil
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd
from mlflow import MlflowClient
from mlflow.entities import LoggedModel, LoggedModelOutput, LoggedModelStatus
from mlflow.models import Model, ModelSignature
from mlflow.types import ColSpec, DataType, ParamSchema, ParamSpec, Schema, TensorSpec

import dmd2
import infra
from dmd2.family import ModelFamily, family_class

# Not "student": MLflow lists a logged model of the same name as a run artifact folder would be listed, and
# the run already has the export as its "student" artifacts.
LOGGED_MODEL_NAME = "student-model"
STUDENT_ARTIFACT = "student"  # the export, under the model's artifacts/
# What predict imports beyond the standard library; pinned to this environment's releases.
REQUIREMENTS = ("torch", "diffusers", "transformers", "accelerate", "safetensors", "numpy", "pandas")
# The project's code goes with the model, so a serving environment needs only the requirements; the
# model is this code (models-from-code), not a pickled object.
CODE_PATHS = (Path(dmd2.__file__).parent, Path(infra.__file__).parent)
MODEL_CODE = Path(__file__).with_name("student_model_code.py")


class StudentModel(mlflow.pyfunc.PythonModel):
    """`predict(inputs, params={"seed": s})` -> uint8 pictures [N, *family.generated_shape], one per input.

    The inputs are one column (class labels or prompts): a list, an array, a Series or a one-column
    DataFrame; MLflow's schema enforcement hands every one of them to `predict` as a DataFrame.
    """

    def load_context(self, context) -> None:
        config = context.model_config
        family = family_class(config["family"])()
        self._generate = family.student_generator(Path(context.artifacts[STUDENT_ARTIFACT]), config["settings"])

    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> np.ndarray:
        images = self._generate(model_input.iloc[:, 0].tolist(), int((params or {}).get("seed", 0)))
        return np.stack(images) if images else np.zeros((0,), dtype=np.uint8)


def student_signature(family: ModelFamily) -> ModelSignature:
    """One column of class labels (long) or prompts (string) in, a uint8 batch of pictures out, a seed param.

    The column is unnamed, so a plain list or array matches it by position."""
    if not family.generate_example:
        raise ValueError(f"the {family.name} family gives no generate_example: it cannot be logged as a model")
    kind = DataType.string if isinstance(family.generate_example[0], str) else DataType.long
    return ModelSignature(inputs=Schema([ColSpec(kind)]),
                          outputs=Schema([TensorSpec(np.dtype(np.uint8), (-1, *family.generated_shape))]),
                          params=ParamSchema([ParamSpec("seed", DataType.long, 0)]))


def pip_requirements() -> list[str]:
    found = []
    for name in REQUIREMENTS:
        try:
            found.append(f"{name}=={version(name).split('+')[0]}")  # no local label: torch 2.x+cpu is 2.x on PyPI
        except PackageNotFoundError:
            continue
    return found


def log_student_model(client: MlflowClient, mlflow_run_id: str, student_dir: Path, family: ModelFamily,
                      settings: dict[str, Any], step: int = 0) -> LoggedModel:
    """Log the export in `student_dir` as an MLflow model (a READY LoggedModel, an output of the run at `step`).

    `settings`: `family.generation_settings(config)`, kept in the model's config. The export is copied
    into the model: staged beside `student_dir` (an SD3 pipeline is GBs; a temp folder may be small).
    """
    run = client.get_run(mlflow_run_id)
    logged = client.create_logged_model(run.info.experiment_id, name=LOGGED_MODEL_NAME, source_run_id=mlflow_run_id,
                                        params={f"generate.{k}": str(v) for k, v in settings.items()},
                                        tags={"dmd2.family": family.name})
    try:
        staging = Path(tempfile.mkdtemp(prefix=".mlflow-model-", dir=Path(student_dir).parent))
        try:
            model = Model(artifact_path=logged.artifact_location, run_id=mlflow_run_id, model_uuid=logged.model_id,
                          model_id=logged.model_id)
            mlflow.pyfunc.save_model(
                staging / "model", mlflow_model=model, python_model=str(MODEL_CODE),
                artifacts={STUDENT_ARTIFACT: str(Path(student_dir).resolve())}, code_paths=[str(p) for p in CODE_PATHS],
                model_config={"family": family.name, "settings": dict(settings)},
                signature=student_signature(family),
                input_example=list(family.generate_example),
                pip_requirements=pip_requirements())
            client.log_model_artifacts(logged.model_id, str(staging / "model"))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        client.log_outputs(mlflow_run_id, [LoggedModelOutput(logged.model_id, step)])
    except BaseException:
        client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        raise
    return client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
