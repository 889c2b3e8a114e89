"""Tests of ``pipeline/interchange/``: exports and imports."""
