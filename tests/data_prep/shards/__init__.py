"""Tests of ``data_prep/shards/``: the format, the loader, object storage."""
