"""Tests of ``pipeline/run_dir/``: the claim, the lock, metrics.jsonl, checkpoints and their rank
files, resume, resharding and safe loading."""
