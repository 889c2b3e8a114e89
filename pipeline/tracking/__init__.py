"""MLflow tracking of a run: one MLflow run per training run, logged from a background queue,
and the run's records (metrics.jsonl and MLflow). The manual: docs/mlflow.md."""
