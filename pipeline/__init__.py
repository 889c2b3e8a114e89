"""Training and its run directory: the config (``config``), the training loop (``training/``),
the run directory and its checkpoints (``run_dir/``), MLflow tracking (``tracking/``), and
models in and out of unmask (``interchange/``). The map: docs/concepts.md."""
