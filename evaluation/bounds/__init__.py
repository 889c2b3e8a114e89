"""Zero-shot bounds: the evaluation sets and their detokenizers, the protocols that read them, the
bound estimator, and the scoring of an export on them. See docs/evaluation.md.
"""
