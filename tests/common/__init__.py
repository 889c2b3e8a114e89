"""Tests of ``common/``."""
