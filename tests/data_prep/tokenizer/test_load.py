"""Loading a tokenizer from a path (``data_prep.tokenizer.load``): what is not there, or not a
tokenizer, is refused naming the path."""

import pytest

from common.errors import UserError
from data_prep.tokenizer.load import load_tokenizer


def test_load_missing_path(tmp_path):
    with pytest.raises(UserError, match="does-not-exist.*does not exist"):
        load_tokenizer(tmp_path / "does-not-exist")


def test_load_directory_without_tokenizer_files(tmp_path):
    (tmp_path / "encoder.json").write_text("{}")  # GPT-2 needs vocab.bpe too
    with pytest.raises(UserError, match=f"{tmp_path}.*tokenizer.model.*vocab.bpe"):
        load_tokenizer(tmp_path)


def test_load_file_that_is_not_a_model(tmp_path):
    (tmp_path / "bogus.model").write_bytes(b"not a model")
    with pytest.raises(UserError, match="bogus.model is not a SentencePiece model"):
        load_tokenizer(tmp_path / "bogus.model")


def test_an_emptied_model_is_named_empty_not_blamed_on_a_missing_eos_piece(tmp_path):
    """sentencepiece loads 0 bytes as a model of no pieces, whose missing EOS was the complaint."""
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.model").write_bytes(b"")
    with pytest.raises(UserError, match=r"tokenizer/tokenizer.model is empty \(0 bytes, no pieces\): truncated or "
                                        r"emptied; copy it again from where it was trained$"):
        load_tokenizer(tmp_path / "tokenizer")
