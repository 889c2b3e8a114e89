"""Tests of the ``unmask`` command line (``orchestration/``)."""
