"""MLflow: the pipeline's run, its epoch metrics, the model registry and the champion gate (no Prefect)."""
