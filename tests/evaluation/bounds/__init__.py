"""Tests of ``evaluation/bounds/``."""
