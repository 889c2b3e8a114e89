"""Whole commands and the project's own promises: ``unmask run``, the manual, packaging, the benches."""
