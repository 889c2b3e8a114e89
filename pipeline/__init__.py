"""Training pipeline: the DeepSpeed trainer, checkpoints, export and the ``unmask`` CLI."""
