"""Tests of ``pipeline/``: the config and the process group; training, the run directory,
tracking and interchange in the folders of the same names (fixtures they share: conftest.py)."""
