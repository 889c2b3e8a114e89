"""The run directory: its layout, claim and lock, metrics.jsonl, and its checkpoints (integrity,
rank files, resume checks, resharding, safe loading). The manual: docs/training.md#run-directory."""
