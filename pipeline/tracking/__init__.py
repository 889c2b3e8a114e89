"""MLflow tracking of a run: one MLflow run per training run, logged from a background queue."""
