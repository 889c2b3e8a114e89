"""Tests of ``evaluation/report/``."""
