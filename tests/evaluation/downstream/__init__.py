"""Tests of ``evaluation/downstream/``."""
