"""The project's own promises, end to end: the manual, packaging, the benches, the GPU check."""
