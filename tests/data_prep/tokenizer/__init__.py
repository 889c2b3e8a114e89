"""Tests of ``data_prep/tokenizer/``."""
