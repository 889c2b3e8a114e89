"""Tests of ``pipeline/run_dir/``: checkpoints, the lock, resume messages."""
