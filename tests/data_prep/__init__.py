"""Tests of ``data_prep/``: readers and the prep."""
