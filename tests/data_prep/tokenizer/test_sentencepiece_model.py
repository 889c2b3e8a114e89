"""SentencePiece models (``data_prep.tokenizer.sentencepiece_model``): exact round trips on all of
tinyshakespeare, the special ids and the metadata a trained model writes, deterministic training
on a bounded uniform sample of sentences, foreign models loaded, and the user errors of
training. The contract every tokenizer keeps: test_base."""

import hashlib
import json
import random

import pytest
import sentencepiece as spm

from common.errors import UserError
from data_prep.tokenizer.load import load_tokenizer
from data_prep.tokenizer.sentencepiece_model import (
    BOS_ID,
    EOS_ID,
    MAX_SENTENCE_BYTES,
    MIN_VOCAB_SIZE,
    NUM_BYTE_PIECES,
    NUM_SPECIAL_PIECES,
    PAD_ID,
    UNK_ID,
    draw_sentence_sample,
    train_sentencepiece,
)
from tests.support.paths import TINY as SHAKESPEARE
from tests.support.paths import require_shared
from tests.support.tokenizer_fixtures import (
    SENTENCEPIECE_SAMPLE_SENTENCES,
    SENTENCEPIECE_VOCAB_SIZE,
    shakespeare_documents,
)

VOCAB_SIZE = SENTENCEPIECE_VOCAB_SIZE  # the shared models' (conftest.py)
SAMPLE_SENTENCES = SENTENCEPIECE_SAMPLE_SENTENCES


# ----------------------------------------------------------------------------- round trips
def test_sentencepiece_round_trips_all_of_shakespeare(trained):
    tokenizer, _ = trained
    text = require_shared(SHAKESPEARE).read_text(encoding="utf-8")
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    # Learned pieces do the work: far fewer tokens than bytes.
    assert len(ids) < 0.6 * len(text.encode("utf-8"))


def test_literal_meta_space_is_not_a_space(trained):
    tokenizer, _ = trained
    assert tokenizer.encode("a\u2581b") != tokenizer.encode("a b")
    assert tokenizer.decode(tokenizer.encode("a\u2581b")) == "a\u2581b"


# ----------------------------------------------------------------------------- training
def test_trained_special_ids_and_metadata(trained):
    tokenizer, out_dir = trained
    assert (UNK_ID, BOS_ID, EOS_ID, PAD_ID) == (0, 1, 2, 3)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert tokenizer.vocab_size == VOCAB_SIZE
    model_bytes = (out_dir / "tokenizer.model").read_bytes()
    assert tokenizer.sha256 == hashlib.sha256(model_bytes).hexdigest()

    pieces = [line.split("\t")[0] for line in
              (out_dir / "tokenizer.vocab").read_text(encoding="utf-8").splitlines()]
    assert pieces[:NUM_SPECIAL_PIECES] == ["<unk>", "<s>", "</s>", "<pad>"]
    assert pieces[NUM_SPECIAL_PIECES:NUM_SPECIAL_PIECES + NUM_BYTE_PIECES] == [
        f"<0x{b:02X}>" for b in range(NUM_BYTE_PIECES)]
    assert len(pieces) == VOCAB_SIZE

    metadata = json.loads((out_dir / "tokenizer.json").read_text())
    assert metadata["kind"] == "sentencepiece"
    assert metadata["sha256"] == tokenizer.sha256
    assert metadata["vocab_size"] == VOCAB_SIZE
    assert metadata["model_type"] == metadata["train_options"]["model_type"]
    assert (metadata["unk_id"], metadata["bos_id"], metadata["eos_id"], metadata["pad_id"]) == (
        UNK_ID, BOS_ID, EOS_ID, PAD_ID)
    assert metadata["train_options"]["byte_fallback"] is True
    assert metadata["train_options"]["normalization_rule_name"] == "identity"
    assert metadata["sentences_sampled"] == SAMPLE_SENTENCES
    assert metadata["documents_seen"] == len(shakespeare_documents())
    assert not list(out_dir.glob(".*tmp*")), "temporary files were left behind"


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_training_is_deterministic_and_seeded(tmp_path, model_type):
    documents = shakespeare_documents()

    def model_bytes(name: str, seed: int) -> bytes:
        train_sentencepiece(iter(documents), tmp_path / name, VOCAB_SIZE, model_type,
                            sample_sentences=2000, seed=seed)
        return (tmp_path / name / "tokenizer.model").read_bytes()

    first = model_bytes("first", seed=0)
    assert model_bytes("second", seed=0) == first
    assert model_bytes("other-seed", seed=1) != first


def test_training_sample_is_bounded(tmp_path):
    def documents():  # 30,000 sentences, streamed
        rng = random.Random(0)
        for _ in range(10_000):
            yield "\n".join(" ".join(rng.choices(["to", "be", "or", "not", "that", "is", "the",
                                                   "question", "whether", "tis", "nobler"], k=12))
                            for _ in range(3))

    train_sentencepiece(documents(), tmp_path, MIN_VOCAB_SIZE + 50, sample_sentences=1000)
    metadata = json.loads((tmp_path / "tokenizer.json").read_text())
    assert metadata["documents_seen"] == 10_000
    assert metadata["sentences_seen"] == 30_000
    assert metadata["sentences_sampled"] == 1000


def test_sample_is_uniform_over_the_stream_and_deterministic():
    documents = [f"line {i}" for i in range(10_000)]
    sample = draw_sentence_sample(documents, 500, seed=3)
    assert len(sample.sentences) == 500 == len(set(sample.sentences))
    positions = sorted(int(s.split()[1]) for s in sample.sentences)
    # A uniform sample puts about half of itself in the second half of the stream.
    assert 200 < sum(p >= 5000 for p in positions) < 300
    assert draw_sentence_sample(documents, 500, seed=3) == sample
    assert draw_sentence_sample(documents, 500, seed=4) != sample


def test_sample_skips_empty_lines_and_cuts_long_ones():
    long_line = "é" * (MAX_SENTENCE_BYTES + 10)  # 2 bytes per character
    sample = draw_sentence_sample(["a\n\n\nb\n", "", long_line], size=100)
    assert sample.sentences[:2] == ["a", "b"]
    pieces = sample.sentences[2:]
    assert "".join(pieces) == long_line
    assert all(len(p.encode("utf-8")) <= MAX_SENTENCE_BYTES for p in pieces)
    assert (sample.documents_seen, sample.sentences_seen) == (3, len(sample.sentences))


# ----------------------------------------------------------------------------- loading
def test_load_model_file_directly(trained):
    tokenizer, out_dir = trained
    assert load_tokenizer(out_dir / "tokenizer.model").sha256 == tokenizer.sha256


def test_load_foreign_sentencepiece_model_without_bos_or_pad(tmp_path):
    lines = shakespeare_documents()[:300]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "m"),
                                   vocab_size=200, bos_id=-1, pad_id=-1, minloglevel=2)
    tokenizer = load_tokenizer(tmp_path / "m.model")
    assert (tokenizer.bos_id, tokenizer.pad_id, tokenizer.eos_id) == (None, None, 2)
    assert tokenizer.vocab_size == 200
    assert tokenizer.decode(tokenizer.encode("First Citizen")) == "First Citizen"


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("vocab_size", [0, NUM_SPECIAL_PIECES + NUM_BYTE_PIECES, 300.0])
def test_vocab_size_below_the_byte_pieces(tmp_path, vocab_size):
    with pytest.raises(UserError, match=f"--vocab-size must be an integer >= {MIN_VOCAB_SIZE}"):
        train_sentencepiece(["some text"], tmp_path, vocab_size)


def test_vocab_size_too_small_for_the_corpus_characters(tmp_path):
    with pytest.raises(UserError, match=r"--vocab-size 270 is too small .* at least \d+"):
        train_sentencepiece(shakespeare_documents(), tmp_path, 270, sample_sentences=1000)


def test_vocab_size_too_large_for_the_sample(tmp_path):
    with pytest.raises(UserError, match=r"--vocab-size 20000 is too large .* \[261, \d+\]"):
        train_sentencepiece(shakespeare_documents(), tmp_path, 20_000, sample_sentences=200)
    assert not (tmp_path / "tokenizer.model").exists()


@pytest.mark.parametrize("model_type", ["word", "char", "BPE"])
def test_bad_model_type(tmp_path, model_type):
    with pytest.raises(UserError, match=f"--model-type '{model_type}'.*bpe, unigram"):
        train_sentencepiece(["some text"], tmp_path, 1000, model_type)


@pytest.mark.parametrize("documents", [[], ["", "\n\n"]])
def test_empty_corpus(tmp_path, documents):
    with pytest.raises(UserError, match="no text"):
        train_sentencepiece(iter(documents), tmp_path, 1000)
