"""Tests of ``pipeline/tracking/`` against a real ``mlflow server``."""
