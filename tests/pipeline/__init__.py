"""Tests of ``pipeline/``: the config."""
