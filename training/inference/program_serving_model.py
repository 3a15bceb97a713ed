"""The file MLflow logs as a training script's pyfunc model (see training/inference/program_serving.py).

MLflow executes this file when the model is loaded, with the logged ``code/`` directory (the ``training``
package) on ``sys.path``; it is never imported by the project itself.
"""

from mlflow.models import set_model

from training.inference.program_serving import ExportedProgramModel

set_model(ExportedProgramModel())
