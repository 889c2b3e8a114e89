"""Tests of ``evaluation/generation/``."""
