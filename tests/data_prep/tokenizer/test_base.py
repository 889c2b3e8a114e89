"""The contract every tokenizer keeps (``data_prep.tokenizer.base``), checked on each kind
(``any_tokenizer``: GPT-2's BPE, SentencePiece BPE and Unigram, a tokenizer.json): exact round
trips of tricky and random text, batches equal to one text at a time, EOS after each document's
end, lone surrogates refused alike, pickling with the model bytes, save/load identity. Each
kind's own tests: test_gpt2_bpe, test_sentencepiece_model, test_hugging_face."""

import pickle
import random
import shutil

import pytest

from data_prep.tokenizer.load import load_tokenizer

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
