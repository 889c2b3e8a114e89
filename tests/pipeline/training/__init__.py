"""Tests of ``pipeline/training/``: the loop end to end (real DeepSpeed training on CPU) and
its parts."""
