"""Tests of ``data_prep/readers/``: one module per reader module (inputs, planning, the formats,
bytes, pieces, options); the helpers they share: ``tests.support.readers``."""
