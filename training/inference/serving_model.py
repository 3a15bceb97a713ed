"""The file MLflow logs as the pyfunc model ("models from code"; see training/inference/serving.py).

MLflow executes this file when the model is loaded, with the logged
``code/`` directory (the ``training`` package) on ``sys.path``; it is never
imported by the project itself.
"""

from mlflow.models import set_model

from training.inference.serving import TabularTorchModel

set_model(TabularTorchModel())
