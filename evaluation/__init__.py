"""Evaluation: zero-shot datasets and detokenizers, the bound estimator, sampling, typed
results, reports, and the zero-shot job that ties them together (``evaluation.zero_shot``)."""
