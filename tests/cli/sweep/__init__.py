"""Tests of ``unmask sweep`` (``orchestration/sweep/``): the sweep file, its plan, trials on Ray, the report."""
