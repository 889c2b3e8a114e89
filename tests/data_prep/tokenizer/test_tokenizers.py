"""Tokenizers of every kind: exact round trips, GPT-2's known ids, deterministic bounded
training, pickling with the model bytes, save/load identity, lone surrogates refused, and the
user errors. GPT-2's ids against the reference BPE: test_gpt2_bpe; tokenizer.json files of
every model type: test_hf_tokenizer."""

import hashlib
import json
import pickle
import random
import shutil
from pathlib import Path

import pytest
import sentencepiece as spm

from common.errors import UserError
from data_prep.tokenizer.gpt2_bpe import GPT2BPETokenizer
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
    SentencePieceTokenizer,
    draw_sentence_sample,
    train_sentencepiece,
)
from tests.support.paths import GPT2 as GPT2_DIR
from tests.support.paths import PTB as PTB_TEST
from tests.support.paths import TINY as SHAKESPEARE
from tests.support.paths import require_shared
from tests.support.tokenizer_fixtures import byte_level_bpe

# Small enough to train in well under a second, large enough for real merges.
VOCAB_SIZE = 512
SAMPLE_SENTENCES = 4000

TRICKY = [
    "", " ", "  ", "\n", "\t", "   leading spaces", "trailing spaces   ", "a  b   c    d",
    "tabs\tand\ttabs\t\t", "lines\nand\r\nmore\n\n\nlines\n", "\x00nul\x00", "\x1b[31mred\x1b[0m",
    "emoji 😀👍🏽👨‍👩‍👧 flags 🇫🇷", "中文字符和日本語のテキスト", "한국어", "e\u0301 a\u0308 n\u0303",
    "\u2581", "x\u2581y \u2581\u2581 z\u2581", "\ufeffbom", "\ufffd", "\u3000ideographic space",
    "\u00a0nbsp\u2028line sep\u2029para sep\x85nel", "<|endoftext|>", "<unk><s></s><pad>",
    "<0x41>", "Ω≈ç√∫˜µ≤≥÷", "\U0010fffd\U000e0001",
]


def random_text(rng: random.Random) -> str:
    """A random string mixing words, whitespace runs, control characters, combining marks,
    CJK, emoji, U+2581 and arbitrary code points (never surrogates, which are not UTF-8)."""
    ranges = [(0x00, 0x7F), (0x80, 0x24F), (0x300, 0x36F), (0x4E00, 0x9FFF),
              (0x1F300, 0x1FAFF), (0x2580, 0x259F), (0x0, 0x10FFFF)]
    parts = []
    for _ in range(rng.randrange(40)):
        kind = rng.randrange(4)
        if kind == 0:
            parts.append(rng.choice(["the", "king", "thou", "hello", "world", "1234"]))
        elif kind == 1:
            parts.append(rng.choice(" \t\n\r\x0b\x0c\u00a0\u3000") * rng.randint(1, 4))
        else:
            parts.append(random_char(rng, *rng.choice(ranges)))
    return "".join(parts)


def random_char(rng: random.Random, low: int, high: int) -> str:
    code = rng.randint(low, high)
    return random_char(rng, low, high) if 0xD800 <= code <= 0xDFFF else chr(code)


RANDOM_TEXTS = [random_text(random.Random(seed)) for seed in range(400)]


def shakespeare_documents() -> list[str]:
    return require_shared(SHAKESPEARE).read_text(encoding="utf-8").split("\n\n")


@pytest.fixture(scope="module")
def gpt2() -> GPT2BPETokenizer:
    require_shared(GPT2_DIR / "encoder.json")
    require_shared(GPT2_DIR / "vocab.bpe")
    tokenizer = load_tokenizer(GPT2_DIR)
    assert isinstance(tokenizer, GPT2BPETokenizer)
    return tokenizer


@pytest.fixture(scope="module")
def sentencepiece_models(tmp_path_factory) -> dict[str, tuple[SentencePieceTokenizer, Path]]:
    """One trained model (and its directory) per model type."""
    models = {}
    for model_type in ("bpe", "unigram"):
        out_dir = tmp_path_factory.mktemp(f"sp-{model_type}")
        models[model_type] = (train_sentencepiece(shakespeare_documents(), out_dir, VOCAB_SIZE,
                                                  model_type, sample_sentences=SAMPLE_SENTENCES),
                              out_dir)
    return models


@pytest.fixture(params=["bpe", "unigram"])
def trained(request, sentencepiece_models) -> tuple[SentencePieceTokenizer, Path]:
    return sentencepiece_models[request.param]


@pytest.fixture(scope="module")
def byte_level_tokenizer_json(tmp_path_factory):
    """A byte-level BPE tokenizer.json: the kind of tokenizer.json that is exact."""
    return load_tokenizer(byte_level_bpe(tmp_path_factory.mktemp("hf") / "tokenizer.json"))


@pytest.fixture(params=["gpt2-bpe", "sentencepiece-bpe", "sentencepiece-unigram", "tokenizer-json"])
def any_tokenizer(request):
    if request.param == "gpt2-bpe":
        return request.getfixturevalue("gpt2")
    if request.param == "tokenizer-json":
        return request.getfixturevalue("byte_level_tokenizer_json")
    model_type = request.param.removeprefix("sentencepiece-")
    return request.getfixturevalue("sentencepiece_models")[model_type][0]


# ----------------------------------------------------------------------------- GPT-2


def test_gpt2_known_ids(gpt2):
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.encode(" the") == [262]
    assert gpt2.vocab_size == 50257
    assert gpt2.eos_id == gpt2.bos_id == 50256
    assert gpt2.pad_id is None
    assert gpt2.decode([50256]) == "<|endoftext|>"


def test_gpt2_text_cannot_forge_the_end_of_text_token(gpt2):
    assert 50256 not in gpt2.encode("a document that says <|endoftext|> in its text")


def test_gpt2_sha256_is_encoder_then_merges(gpt2):
    expected = hashlib.sha256((GPT2_DIR / "encoder.json").read_bytes()
                              + (GPT2_DIR / "vocab.bpe").read_bytes()).hexdigest()
    assert gpt2.sha256 == expected
    assert gpt2.describe() == {"kind": "gpt2-bpe", "path": str(GPT2_DIR), "sha256": expected,
                               "vocab_size": 50257, "eos_id": 50256, "bos_id": 50256,
                               "pad_id": None}


def test_gpt2_round_trips_ptb_test(gpt2):
    text = require_shared(PTB_TEST).read_text(encoding="utf-8")
    assert gpt2.decode(gpt2.encode(text)) == text
    lines = text.splitlines(keepends=True)
    assert [gpt2.decode(ids) for ids in gpt2.encode_batch(lines)] == lines


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_tricky(any_tokenizer, text):
    ids = any_tokenizer.encode(text)
    assert any_tokenizer.decode(ids) == text
    assert all(0 <= i < any_tokenizer.vocab_size for i in ids)


def test_round_trip_random_unicode(any_tokenizer):
    for text in RANDOM_TEXTS:
        assert any_tokenizer.decode(any_tokenizer.encode(text)) == text, repr(text)


def test_encode_batch_equals_encode(any_tokenizer):
    texts = RANDOM_TEXTS[:100] + TRICKY
    assert any_tokenizer.encode_batch(texts) == [any_tokenizer.encode(t) for t in texts]


def test_encode_pieces_is_encode_batch_with_eos_after_each_end(any_tokenizer):
    texts = RANDOM_TEXTS[:100] + TRICKY
    some_end = [index % 3 != 1 for index in range(len(texts))]
    for batch_ends in (some_end, [True] * len(texts)):
        tokens, counts = any_tokenizer.encode_pieces(texts, batch_ends)
        encoded = any_tokenizer.encode_batch(texts)
        expected = [ids + [any_tokenizer.eos_id] * end for ids, end in zip(encoded, batch_ends)]
        assert counts.tolist() == list(map(len, expected))
        assert tokens.tolist() == [token for ids in expected for token in ids]


@pytest.mark.parametrize("text", ["\ud800", "a\udc80b", "\ud83d\ude00"])
def test_lone_surrogates_are_refused_alike(any_tokenizer, text):
    """Not Unicode text: no ids could decode back to it, and no kind guesses a repair."""
    with pytest.raises(ValueError, match="text 0 holds a lone surrogate"):
        any_tokenizer.encode(text)
    with pytest.raises(ValueError, match="text 1 holds a lone surrogate"):
        any_tokenizer.encode_batch(["fine", text])
    with pytest.raises(ValueError, match="text 1 holds a lone surrogate"):
        any_tokenizer.encode_pieces(["fine", text], [True, True])


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


# ----------------------------------------------------------------------------- pickle, save, load


def test_pickle_carries_the_model_bytes(any_tokenizer, tmp_path):
    any_tokenizer.save(tmp_path / "copy")
    loaded = load_tokenizer(tmp_path / "copy")
    payload = pickle.dumps(loaded)
    shutil.rmtree(tmp_path / "copy")  # an unpickling machine has no such path
    clone = pickle.loads(payload)
    assert type(clone) is type(any_tokenizer)
    assert clone.describe() == loaded.describe()
    assert clone.sha256 == any_tokenizer.sha256
    texts = RANDOM_TEXTS[:50] + TRICKY
    assert clone.encode_batch(texts) == any_tokenizer.encode_batch(texts)


def test_save_then_load_is_identical(any_tokenizer, tmp_path):
    any_tokenizer.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.sha256 == any_tokenizer.sha256
    assert {k: v for k, v in loaded.describe().items() if k != "path"} == {
        k: v for k, v in any_tokenizer.describe().items() if k != "path"}
    assert loaded.encode_batch(TRICKY) == any_tokenizer.encode_batch(TRICKY)


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
