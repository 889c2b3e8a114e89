"""Downstream tasks through lm-evaluation-harness: conditional log-likelihoods of any model, the lm-
eval model, the local tasks and their results."""
