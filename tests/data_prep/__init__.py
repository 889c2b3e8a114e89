"""Tests of ``data_prep/``: the readers, the tokenizers, the shards, and the prep (its two stages,
the shard writer and its resume)."""
