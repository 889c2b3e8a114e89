"""The report of an evaluation: typed results rendered as Markdown, HTML and plots, with the published
numbers beside them, and their MLflow record. See docs/evaluation.md#the-report.
"""
