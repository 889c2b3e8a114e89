"""Evaluation: zero-shot datasets and detokenizers, the bound estimator, sampling, reports."""
