"""Tests of ``data_prep/tokenizer/``: the contract every tokenizer keeps (test_base), then each kind."""
