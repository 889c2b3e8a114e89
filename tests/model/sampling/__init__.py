"""Tests of ``model/sampling/``: every sampler's law, cost and plan."""
