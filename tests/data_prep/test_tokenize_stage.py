"""Stage 1 of the prep works on batches of pieces as arrays; its output equals a plain
piece-by-piece statement of the rule (encode each piece, EOS after a document's last piece,
the document's split from a keyed hash of its first piece), whatever the batch size and
however documents straddle batches."""

import hashlib
import json

import numpy as np
import pytest

from data_prep.readers import ReadCounters, ReadOptions, formats, plan_units, read_unit, resolve_inputs
from data_prep.shards.format import SPLITS, token_dtype
from data_prep.tokenize_stage import SplitRule, tokenize_unit
from data_prep.tokenizer.load import load_tokenizer
from tests.support.paths import GPT2, TINY, needs_shared

pytestmark = needs_shared(TINY, GPT2)
SEED, VAL_FRACTION = 11, 0.4


def is_val_by_definition(seed: int, val_fraction: float, data: bytes) -> bool:
    """The split rule as the docs state it: val when the keyed blake2b-64 of the document's
    first piece, read little-endian, lies below val_fraction * 2**64."""
    digest = hashlib.blake2b(data, digest_size=8, key=seed.to_bytes(8, "little", signed=True)).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


def piece_by_piece(unit, tokenizer, options) -> dict[str, tuple[list[int], list[tuple[int, int]]]]:
    """Each split's tokens and (tokens, bytes) per document, one piece at a time."""
    out = {split: ([], []) for split in SPLITS}
    for piece in read_unit(unit, options, ReadCounters()):
        if piece.first:
            split = "val" if is_val_by_definition(SEED, VAL_FRACTION, piece.text.encode()) else "train"
            doc_tokens = doc_bytes = 0
        ids = tokenizer.encode(piece.text) + [tokenizer.eos_id] * piece.last
        out[split][0].extend(ids)
        doc_tokens, doc_bytes = doc_tokens + len(ids), doc_bytes + len(piece.text.encode())
        if piece.last:
            out[split][1].append((doc_tokens, doc_bytes))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Short paragraphs, one over a thousand pieces long, and a JSONL file holding documents
    that write <|endoftext|> and that need repair."""
    root = tmp_path_factory.mktemp("corpus")
    text = TINY.read_text()[:60_000]
    (root / "a.txt").write_text(text[:30_000] + "\n\n" + "long " * 3000 + "\n\n" + text[30_000:])
    records = [f"record {i} " * (i % 7 + 1) for i in range(400)]
    records[5] = "a document that writes <|endoftext|> in its text"
    records[9] = "lone \udc80 surrogate"
    (root / "b.jsonl").write_text("\n".join(json.dumps({"text": r}) for r in records))
    return root


@pytest.mark.parametrize("batch_pieces", [1, 3, 256])
@pytest.mark.parametrize("max_piece_bytes", [16, 1 << 20])
def test_batches_equal_the_piece_by_piece_rule(corpus, tmp_path, monkeypatch, batch_pieces, max_piece_bytes):
    monkeypatch.setattr(formats, "BATCH_PIECES", batch_pieces)
    gpt2 = load_tokenizer(GPT2)
    options = ReadOptions(max_piece_bytes=max_piece_bytes)
    units = plan_units(resolve_inputs([str(corpus)]), options, 20_000)
    assert len(units) > 2
    documents = {split: 0 for split in SPLITS}
    for unit in units:
        prefix = tmp_path / f"{unit.index:06d}"
        entry = tokenize_unit(unit, gpt2, options, SplitRule(SEED, VAL_FRACTION), prefix, token_dtype(gpt2.vocab_size))
        for split, (tokens, table) in piece_by_piece(unit, gpt2, options).items():
            got = np.fromfile(prefix.with_name(f"{prefix.name}.{split}.tokens"), dtype=token_dtype(gpt2.vocab_size))
            assert got.tolist() == tokens, f"unit {unit.index} {split}"
            got_table = np.load(prefix.with_name(f"{prefix.name}.{split}.docs.npy"))
            assert [tuple(row) for row in got_table.tolist()] == table, f"unit {unit.index} {split}"
            assert entry["splits"][split] == {"tokens": len(tokens), "documents": len(table),
                                              "utf8_bytes": sum(b for _, b in table)}
            documents[split] += len(table)
    assert min(documents.values()) > 50  # both splits are exercised


def test_split_rule_is_the_stated_hash_threshold():
    rng = np.random.default_rng(0)
    texts = [rng.bytes(int(n)) for n in rng.integers(0, 40, 3000)]
    for seed, fraction in [(0, 0.005), (SEED, VAL_FRACTION), (-3, 0.5), (7, 0.0), (1, 1 - 2**-53)]:
        expected = [is_val_by_definition(seed, fraction, t) for t in texts]
        assert SplitRule(seed, fraction).is_val(texts).tolist() == expected
