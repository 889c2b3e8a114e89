"""Tests of ``model/sampling/``: one module per sampler, the plan, the shared draw and core."""
