"""Evaluation: the zero-shot bounds and their report (``unmask eval``, ``evaluation.zero_shot``),
text generation and its quality, downstream tasks through lm-eval (``unmask lm-eval``,
``evaluation.downstream.run``) and the typed results files they write (``evaluation.results``).
See docs/evaluation.md, docs/sampling.md and docs/downstream.md.
"""
