"""Tests of ``evaluation/``: one module per module, and ``unmask eval`` end to end (test_zero_shot)."""
