"""Tests of ``evaluation/``: ``unmask eval`` and ``unmask lm-eval`` end to end."""
