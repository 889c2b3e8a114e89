"""GPT-2's BPE on tiktoken gives the ids of the reference BPE (the ``tokenizers`` library's,
which the prep used before) on every shared corpus and on adversarial text, reads
``<|endoftext|>`` in a text as text, refuses lone surrogates, and refuses files whose layout
tiktoken cannot encode exactly."""

import hashlib
import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as ReferenceTokenizer

from common.errors import UserError
from data_prep.readers import ReadCounters, ReadOptions, plan_units, read_unit, resolve_inputs
from data_prep.tokenizer.base import Tokenizer
from data_prep.tokenizer.gpt2_bpe import GPT2BPETokenizer
from data_prep.tokenizer.load import load_tokenizer
from tests.support.paths import GPT2 as GPT2_DIR
from tests.support.paths import PTB, needs_shared, require_shared
from tests.support.paths import PTB as PTB_TEST
from tests.support.paths import SHARED as DATA
from tests.support.tokenizer_fixtures import reference_gpt2

EOT = "<|endoftext|>"
QUICK_BYTES = 100_000  # of each corpus, for the quick comparison
GPT2_FILES_SHA256 = "00f404d36600411e497efb3df08d3b4e094f0820e2595afcb7cbd0c4353d4fcb"

pytestmark = needs_shared(GPT2_DIR / "encoder.json", GPT2_DIR / "vocab.bpe")

# The language-modeling corpora of ../shared/data that the readers take as they are.
CORPORA = ("corpora/tinyshakespeare", "ptb", "wikitext-2", "wikitext-2-raw", "lambada", "lm1b")


def shared_corpora() -> list[Path]:
    """Every file of the text corpora in ../shared/data: tinyshakespeare, PTB, WikiText, LAMBADA, 1BW."""
    return sorted(path for corpus in CORPORA for path in (DATA / corpus).rglob("*") if path.is_file())


@pytest.fixture(scope="module")
def reference() -> ReferenceTokenizer:
    return reference_gpt2()


def assert_same_ids(gpt2, reference, texts: list[str]) -> None:
    expected = [encoding.ids for encoding in reference.encode_batch_fast(texts)]
    got = gpt2.encode_batch(texts)
    wrong = [text for text, ids, want in zip(texts, got, expected) if ids != want]
    assert not wrong, f"{len(wrong)} of {len(texts)} texts differ, the first: {wrong[0][:200]!r}"
    assert [gpt2.encode(text) for text in texts[:50]] == expected[:50]


def corpus_documents(paths: list[Path], text_format: str) -> list[str]:
    """The documents as the prep reads them."""
    options = ReadOptions(text_format=text_format)
    return [piece.text for unit in plan_units(resolve_inputs([str(p) for p in paths]), options)
            for piece in read_unit(unit, options, ReadCounters())]


# Adversarial text: each kind the brief of the encoder swap named, and what GPT-2's
# pre-tokenizer treats specially (contractions, whitespace before a word, trailing whitespace).
ADVERSARIAL = [
    # the end-of-text token, written in a document
    EOT, f"a{EOT}b", f" {EOT} ", f"{EOT}{EOT}", "<|endoftext|", "<|endoftext|>>", "<|startoftext|>",
    "<|ENDOFTEXT|>", f"text\n\n{EOT}\n\nmore text",
    # control characters, C0 and C1
    "".join(map(chr, range(0x20))), "\x7f\x80\x85\x9f", "a\x00b\x00\x00c", "\x1b[31mred\x1b[0m", "\r\n\r\r\n",
    # long runs of whitespace, with and without a word after them
    " " * 100_000, "\n" * 50_000, "\t" * 20_000 + "x", " \n" * 30_000, "word" + " " * 5000, " " * 5000 + "word",
    "\u00a0" * 1000 + "x", "\u3000 \u3000" * 500, "\u2028\u2029\x0b\x0c" * 100, "x  \n  y\t\t\n\n",
    # very long words: letters, digits, punctuation, accented, CJK, emoji, one repeated token
    "a" * 200_000, "ab" * 100_000, "1" * 100_000, "!" * 50_000, "é" * 50_000, "中" * 30_000, "😀" * 20_000,
    "Supercalifragilisticexpialidocious" * 3000, "-=" * 40_000, "a1" * 30_000,
    # mixed scripts and emoji
    "English, Ελληνικά, Русский, עברית, العربية, हिन्दी, ไทย, 中文, 日本語, 한국어",
    "👨‍👩‍👧‍👦 👍🏽 🇫🇷🇯🇵 ❤️ 🏳️‍🌈 1️⃣", "e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ﬁ ﬂ Ⅷ ½ ²",
    "\ufeffbom", "\ufffd\ufffe\uffff", "\U0010fffd\U000e0001", "İstanbul ǅ ß ẞ",
    # contractions, in every case, and apostrophe-like marks
    "don't DON'T I'm I'M we'll WE'LL they've THEY'VE you're YOU'RE he'd HE'D it's IT'S",
    "'s 's 'S ''s 'll'll ’s ‘quoted’ `tick`", "rock'n'roll o'clock 'twas",
]


def random_text(rng: random.Random) -> str:
    """Pieces that GPT-2's pattern splits on: words, contractions, digits, punctuation,
    whitespace of every kind, control characters and arbitrary code points."""
    pieces = ["the", " the", "'s", "'LL", "n't", "1234567", "3.14", EOT, "  ", "\r\n", "'", " '", "...", "—",
              "\u200b", "\u00a0", "\u3000", "é", "中文", "😀", "\U0001f3fd", "\u0301"]
    parts = []
    for _ in range(rng.randrange(60)):
        kind = rng.randrange(4)
        if kind == 0:
            parts.append(rng.choice(pieces))
        elif kind == 1:
            parts.append(rng.choice(" \t\n\r\x0b\x0c\x85\u2028\u2029\u00a0\u3000") * rng.randint(1, 6))
        else:
            code = rng.choice([rng.randint(0, 0x7F), rng.randint(0x80, 0x2FF), rng.randint(0, 0x10FFFF)])
            parts.append(chr(code) if not 0xD800 <= code <= 0xDFFF else "x")
    return "".join(parts)


def test_ids_equal_the_reference_on_adversarial_and_random_text(gpt2, reference):
    rng = random.Random(0)
    assert_same_ids(gpt2, reference, ADVERSARIAL + [random_text(rng) for _ in range(3000)])


def test_ids_equal_the_reference_on_the_start_of_every_shared_corpus(gpt2, reference, tmp_path):
    corpora = shared_corpora()
    assert {p.parent.name for p in corpora} >= {"tinyshakespeare", "ptb", "wikitext-2-raw", "lambada", "lm1b"}
    starts = []
    for path in corpora:
        start = tmp_path / path.parent.name / path.name
        start.parent.mkdir(exist_ok=True)
        data = path.read_bytes()[:QUICK_BYTES]
        start.write_bytes(data[:data.rindex(b"\n") + 1])  # whole lines: JSONL must stay JSONL
        starts.append(start)
    for text_format in ("paragraphs", "lines"):
        assert_same_ids(gpt2, reference, corpus_documents(starts, text_format))


@pytest.mark.slow
@pytest.mark.parametrize("text_format", ["paragraphs", "lines"])
def test_ids_equal_the_reference_on_every_shared_corpus(gpt2, reference, text_format):
    for path in shared_corpora():
        assert_same_ids(gpt2, reference, corpus_documents([path], text_format))


def test_end_of_text_in_a_document_is_plain_text(gpt2, reference):
    """As the reference BPE (and GPT-2's own encoder) read it: a document cannot forge a
    boundary, and its ids decode back to the string."""
    for text in (EOT, f"one{EOT}two", f" {EOT}\n"):
        ids = gpt2.encode(text)
        assert gpt2.eos_id not in ids and ids == reference.encode(text).ids
        assert gpt2.decode(ids) == text
    assert gpt2.encode(EOT) == [27, 91, 437, 1659, 5239, 91, 29]  # < | end of text | >
    assert gpt2.decode([gpt2.eos_id]) == EOT


def test_decode_equals_the_reference_on_arbitrary_ids(gpt2, reference):
    """Ids a model samples may cut a character: both give U+FFFD for the broken bytes alike."""
    rng = random.Random(1)
    for _ in range(2000):
        ids = [rng.randrange(gpt2.vocab_size) for _ in range(rng.randrange(1, 12))]
        assert gpt2.decode(ids) == reference.decode(ids), ids
    assert gpt2.decode([]) == ""


@pytest.mark.parametrize("text", ["\ud800", "a\udc80b", "\ud83d\ude00", "fine" * 10 + "\udfff"])
def test_lone_surrogates_are_refused_not_replaced(gpt2, text):
    """tiktoken alone would read them as U+FFFD; the reference refused them too."""
    with pytest.raises(ValueError, match="lone surrogate"):
        gpt2.encode(text)
    with pytest.raises(ValueError, match="text 1 holds a lone surrogate"):
        gpt2.encode_batch(["fine", text])


def test_identity_is_the_files_so_earlier_preps_stay_valid(gpt2):
    """The sha256 that earlier preps (made with the reference BPE) recorded: sha256 of
    encoder.json's bytes then vocab.bpe's. Their shards are the ones this encoder writes
    (test_hugging_face compares shards made both ways), so they stay valid."""
    files = (GPT2_DIR / "encoder.json").read_bytes() + (GPT2_DIR / "vocab.bpe").read_bytes()
    assert gpt2.sha256 == hashlib.sha256(files).hexdigest() == GPT2_FILES_SHA256
    assert gpt2.kind == "gpt2-bpe" and gpt2.describe()["kind"] == "gpt2-bpe"


def write_gpt2_files(directory: Path, encoder: dict[str, int], merges: list[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "encoder.json").write_text(json.dumps(encoder), encoding="utf-8")
    (directory / "vocab.bpe").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    return directory


def test_files_in_another_layout_are_refused_with_the_way_out(tmp_path):
    encoder = json.loads((GPT2_DIR / "encoder.json").read_text(encoding="utf-8"))
    merges = (GPT2_DIR / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:-1]
    # Two merge results swap ids: the reference BPE would take it, tiktoken would not be exact.
    first, second = ("".join(rule.split(" ")) for rule in merges[:2])
    swapped = {**encoder, first: encoder[second], second: encoder[first]}
    with pytest.raises(UserError, match=r"encoder.json: merge rule 0 \(Ġ t\) does not make token 256.*tokenizer.json"):
        load_tokenizer(write_gpt2_files(tmp_path / "swapped", swapped, merges))
    extra = {**encoder, "unmerged": len(encoder)}
    with pytest.raises(UserError, match="expected the 256 byte tokens.*got 50258 tokens"):
        load_tokenizer(write_gpt2_files(tmp_path / "extra", extra, merges))
    with pytest.raises(UserError, match="character ' '.*not one of GPT-2's byte characters"):
        load_tokenizer(write_gpt2_files(tmp_path / "space", {**encoder, "a b": 1}, merges))


def test_pieces_in_one_encoder_call_equal_one_call_per_piece(gpt2, tmp_path):
    """``encode_pieces`` joins whole documents with <|endoftext|> into one call; the ids and
    counts equal the general path's (encode each text, EOS after each document's end) on
    adversarial, random and corpus text, and a batch with a document that writes the token,
    or with a piece that does not end its document, goes the general way."""
    rng = random.Random(1)
    texts = ADVERSARIAL + [random_text(rng) for _ in range(2000)] + corpus_documents([PTB], "lines")[:3000]
    fast = 0
    for start in range(0, len(texts), 7):
        batch = texts[start:start + 7]
        for ends in ([True] * len(batch), [rng.random() < 0.7 for _ in batch]):
            tokens, counts = gpt2.encode_pieces(batch, ends)
            expected_tokens, expected_counts = Tokenizer.encode_pieces(gpt2, batch, ends)
            assert tokens.tolist() == expected_tokens.tolist() and counts.tolist() == expected_counts.tolist()
            fast += all(ends) and not any(EOT in text for text in batch)
    assert fast > 400  # batches that took the one-call path
    one_call = GPT2BPETokenizer.from_directory(GPT2_DIR)
    one_call.encode_batch = None  # the general path's encoder: a batch that takes it fails
    assert one_call.encode_pieces(["a b", " c\n"], [True, True])[1].tolist() == [3, 3]
    for batch, ends in ((["a", f"b{EOT}"], [True, True]), (["a", "b"], [False, True])):
        with pytest.raises(TypeError):
            one_call.encode_pieces(batch, ends)


# ----------------------------------------------------------------------------- known ids, identity, PTB
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
