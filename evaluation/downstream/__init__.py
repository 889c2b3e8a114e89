"""Downstream tasks through lm-evaluation-harness: ``unmask lm-eval`` (``run``), the conditional
log-likelihoods of any model, the lm-eval model that answers with them, and the local tasks.
See docs/downstream.md.
"""
