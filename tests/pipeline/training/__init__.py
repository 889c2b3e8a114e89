"""Tests of ``pipeline/training/``: real DeepSpeed training on CPU."""
