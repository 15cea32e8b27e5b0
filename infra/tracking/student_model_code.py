"""The logged student model's code (MLflow's models-from-code): loading the model runs this file, so
nothing is unpickled; `infra` and `dmd2` travel with the model as its code paths."""

import mlflow

from infra.tracking.student_model import StudentModel

mlflow.models.set_model(StudentModel())
