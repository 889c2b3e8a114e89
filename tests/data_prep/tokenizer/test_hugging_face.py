"""Hugging Face tokenizer.json files (BPE, WordPiece, Unigram, one with a normalizer), built
here with the ``tokenizers`` library: special-token roles found or given, exact round trips
where the pipeline allows them (and where it does not), what the file configures that encoding
ignores, identity, pickling, the user errors, and real preps (``unmask prep`` with a local Ray)."""

import hashlib
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from tokenizers import normalizers

from common.errors import UserError
from data_prep.prep import PrepRequest, prep
from data_prep.shards.format import Manifest, iter_chunks
from data_prep.tokenizer.hugging_face import SPECIAL_TOKENS_MAP_FILE, HuggingFaceTokenizer, SpecialTokens
from data_prep.tokenizer.load import load_tokenizer
from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
from data_prep.write_shards import PrepConfig
from tests.support.cli_runner import run_unmask
from tests.support.paths import GPT2 as GPT2_DIR
from tests.support.paths import TINY as SHAKESPEARE
from tests.support.paths import needs_shared
from tests.support.tokenizer_fixtures import byte_level_bpe, reference_gpt2, unigram, wordpiece

PREP_CHARS = 60_000  # of tinyshakespeare: a prep of a few seconds

pytestmark = needs_shared(SHAKESPEARE)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """One tokenizer.json of each kind, each in a directory of its own."""
    root = tmp_path_factory.mktemp("tokenizers")
    return {"bpe": byte_level_bpe(root / "bpe" / "tokenizer.json"),
            "wordpiece": wordpiece(root / "wordpiece" / "tokenizer.json"),
            "unigram": unigram(root / "unigram" / "tokenizer.json"),
            "nfkc-lower": byte_level_bpe(root / "nfkc" / "tokenizer.json",
                                         normalizer=normalizers.Sequence([normalizers.NFKC(),
                                                                          normalizers.Lowercase()]))}


def roles(tokenizer: HuggingFaceTokenizer) -> tuple:
    return tokenizer.roles["eos"], tokenizer.roles["bos"], tokenizer.roles["pad"]


# ----------------------------------------------------------------------------- roles


def test_roles_are_found_by_the_names_of_the_special_tokens(files):
    bpe, bert, uni = (load_tokenizer(files[kind]) for kind in ("bpe", "wordpiece", "unigram"))
    assert roles(bpe) == ("</s>", "<s>", "<pad>") and bpe.unk_id is None
    assert roles(bert) == ("[SEP]", "[CLS]", "[PAD]") and bert.unk_id == bert.backend.token_to_id("[UNK]")
    assert roles(uni) == ("</s>", "<s>", "<pad>") and uni.unk_id == 0
    for tokenizer in (bpe, bert, uni):
        assert tokenizer.kind == "tokenizer-json"
        assert tokenizer.eos_id == tokenizer.backend.token_to_id(tokenizer.roles["eos"])
        assert tokenizer.describe()["special_tokens"] == tokenizer.roles
    assert load_tokenizer(files["bpe"].parent).sha256 == bpe.sha256  # the directory loads the same


def test_flags_then_files_beside_then_names(files, tmp_path):
    path = byte_level_bpe(tmp_path / "tokenizer.json", special_tokens=("</s>", "<s>", "<pad>", "<|im_end|>"))
    given = load_tokenizer(path, SpecialTokens(eos="<|im_end|>", pad="</s>"))
    assert roles(given) == ("<|im_end|>", "<s>", "</s>") and given.pad_id == given.backend.token_to_id("</s>")
    # transformers' files: a token or {"content": ...}; null says "none"; the map before the config
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|im_end|>", "special": True}, "bos_token": "</s>", "model_max_length": 8}))
    (tmp_path / SPECIAL_TOKENS_MAP_FILE).write_text(json.dumps({"bos_token": None, "pad_token": "<pad>"}))
    assert roles(load_tokenizer(path)) == ("<|im_end|>", None, "<pad>")
    assert roles(load_tokenizer(path, SpecialTokens(bos="<s>"))) == ("<|im_end|>", "<s>", "<pad>")


def test_the_roles_are_part_of_the_identity_and_saved_with_the_file(files, tmp_path):
    found = load_tokenizer(files["bpe"])
    given = load_tokenizer(files["bpe"], SpecialTokens(eos="<s>"))
    data = files["bpe"].read_bytes()
    assert found.sha256 == hashlib.sha256(
        data + b'{"bos":"<s>","eos":"</s>","pad":"<pad>"}').hexdigest() != given.sha256
    given.save(tmp_path / "saved")
    assert (tmp_path / "saved" / "tokenizer.json").read_bytes() == data
    assert json.loads((tmp_path / "saved" / SPECIAL_TOKENS_MAP_FILE).read_text()) == {
        "eos_token": "<s>", "bos_token": "<s>", "pad_token": "<pad>"}
    assert load_tokenizer(tmp_path / "saved").sha256 == given.sha256


# ----------------------------------------------------------------------------- encoding


def test_special_tokens_in_the_text_are_text(files):
    tokenizer = load_tokenizer(files["bpe"])
    text = "a document that says </s> and <s> and <pad> in its text"
    ids = tokenizer.encode(text)
    assert not {tokenizer.eos_id, tokenizer.bos_id, tokenizer.pad_id} & set(ids)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode([tokenizer.eos_id]) == "</s>"
    bert = load_tokenizer(files["wordpiece"])
    assert bert.eos_id not in bert.encode("the end [SEP] of it")


def test_a_model_holding_its_special_tokens_as_pieces_may_spell_them(files):
    """The limit of reading specials as text: the tokenizers library's Unigram trainer puts them
    in the model's vocabulary as ordinary pieces, which the model may choose for the text."""
    uni = load_tokenizer(files["unigram"])
    assert uni.eos_id in uni.encode("a document that says </s> in its text")


def test_encoding_ignores_the_files_template_truncation_and_padding(files):
    bert = load_tokenizer(files["wordpiece"])  # [CLS] $A [SEP], truncation to 512
    long_text = "to be or not to be " * 400
    ids = bert.encode(long_text)
    assert len(ids) == 2400 and bert.bos_id not in ids and bert.eos_id not in ids
    assert bert.encode_batch(["a", long_text]) == [bert.encode("a"), ids]


def test_a_byte_level_bpe_round_trips_exactly(files):
    tokenizer = load_tokenizer(files["bpe"])
    texts = ["", "  two  spaces  ", "\t\ttabs\r\n", "\x00\x1b[0m", "e\u0301 中文 😀👍🏽", "x\u2581y",
             "ＡＢＣ ﬁ",
             SHAKESPEARE.read_text(encoding="utf-8")[:20_000]]
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_where_a_tokenizer_json_does_not_round_trip(files):
    """Lossy by its pipeline, as the manual says (docs/data-preparation.md): normalizers, whitespace-dropping
    pre-tokenizers, unknown tokens, Metaspace's U+2581."""
    lower = load_tokenizer(files["nfkc-lower"])
    assert lower.decode(lower.encode("ＡＢＣ ﬁne Day")) == "abc fine day"
    bert = load_tokenizer(files["wordpiece"])
    assert bert.decode(bert.encode("Hello,  World!\n")) == "hello, world!"
    uni = load_tokenizer(files["unigram"])
    paragraph = "First Citizen:\nBefore we proceed any further, hear me speak."
    assert uni.decode(uni.encode(paragraph)) == paragraph  # exact on text of its vocabulary
    assert uni.decode(uni.encode("a\tb")) == "a<unk>b" and uni.unk_id in uni.encode("a\tb")
    assert uni.decode(uni.encode("x\u2581y")) == "x y"


def test_pickles_with_its_bytes_and_roles(files, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(files["wordpiece"].read_bytes())
    tokenizer = load_tokenizer(path, SpecialTokens(pad="[MASK]"))
    payload = pickle.dumps(tokenizer)
    path.unlink()  # an unpickling machine has no such file
    clone = pickle.loads(payload)
    assert clone.describe() == tokenizer.describe() and clone.sha256 == tokenizer.sha256
    texts = ["Hello there", "To be, or not to be"]
    assert clone.encode_batch(texts) == tokenizer.encode_batch(texts)


# ----------------------------------------------------------------------------- errors


def test_no_eos_is_refused_naming_the_file_and_the_flag(files, tmp_path):
    path = byte_level_bpe(tmp_path / "plain.json", special_tokens=("<s>",))
    with pytest.raises(UserError, match=r"plain.json: no end-of-sequence token.*--eos-token TOKEN"):
        load_tokenizer(path)
    assert load_tokenizer(path, SpecialTokens(eos="<s>")).eos_id == 0
    with pytest.raises(UserError, match=r"plain.json: the eos token 'nope' is not in its vocabulary.*--eos-token"):
        load_tokenizer(path, SpecialTokens(eos="nope"))
    with pytest.raises(UserError, match=r"the pad token '\[PAD\]' is not in its vocabulary.*--pad-token"):
        load_tokenizer(path, SpecialTokens(eos="<s>", pad="[PAD]"))
    # A file beside it that says "no eos" is believed over the names of the special tokens.
    told = tmp_path / "told" / "tokenizer.json"
    told.parent.mkdir()
    told.write_bytes(files["bpe"].read_bytes())  # has </s>
    (told.parent / SPECIAL_TOKENS_MAP_FILE).write_text(json.dumps({"eos_token": None}))
    with pytest.raises(UserError, match="told/tokenizer.json: no end-of-sequence token"):
        load_tokenizer(told)


def test_files_that_are_not_a_tokenizer_json_are_named(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(UserError, match="broken.json is not valid JSON"):
        load_tokenizer(tmp_path / "broken.json")
    (tmp_path / "other.json").write_text(json.dumps({"model": {"type": "Nonsense"}}))
    with pytest.raises(UserError, match="other.json is not a tokenizer.json the tokenizers library can read"):
        load_tokenizer(tmp_path / "other.json")
    trained = tmp_path / "sp"
    train_sentencepiece(SHAKESPEARE.read_text(encoding="utf-8").split("\n\n")[:300], trained, 400)
    assert load_tokenizer(trained).kind == "sentencepiece"  # its tokenizer.json is a record beside the model
    with pytest.raises(UserError, match="record that `unmask tokenizer train` writes.*tokenizer.model"):
        load_tokenizer(trained / "tokenizer.json")
    with pytest.raises(UserError, match="--eos-token: only a Hugging Face tokenizer.json takes special tokens"):
        load_tokenizer(trained, SpecialTokens(eos="</s>"))


# ----------------------------------------------------------------------------- preps


def _corpus(tmp_path: Path) -> Path:
    corpus = tmp_path / "input.txt"
    corpus.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:PREP_CHARS], encoding="utf-8")
    return corpus


def _documents(out: Path, tokenizer) -> list[str]:
    """The documents the shards hold, decoded, over both splits."""
    manifest = Manifest.read(out)
    documents = []
    for split in manifest.splits.values():
        chunks = []
        for shard in split.shards:
            with open(out / shard.path, "rb") as stream:
                chunks.extend(iter_chunks(stream))
        tokens = np.concatenate(chunks).reshape(-1)[:split.tokens].tolist()
        ends = [i for i, token in enumerate(tokens) if token == tokenizer.eos_id]
        documents += [tokenizer.decode(tokens[a + 1:b]) for a, b in zip([-1, *ends], ends)]
    return documents


@pytest.mark.slow
def test_unmask_prep_with_a_tokenizer_json_and_flags_through_ray(files, tmp_path):
    corpus, out = _corpus(tmp_path), tmp_path / "shards"
    args = ["prep", "--input", str(corpus), "--out", str(out), "--seq-len", "64", "--val-fraction", "0.1",
            "--unit-bytes", str(16 << 10), "--tokenizer", str(files["bpe"]), "--eos-token", "<s>",
            "--pad-token", "</s>", "--workers", "2", "--no-progress", "--json"]
    done = run_unmask(args, installed=True)
    assert done.returncode == 0, done.stderr[-4000:]
    # A quiet console: nothing from Ray (token-auth notice, core worker errors, Ray Data's
    # progress-bar warning, deprecations) that the user did not cause.
    assert [line for line in done.stderr.splitlines() if line.strip()] == [], done.stderr[-2000:]
    tokenizer = load_tokenizer(files["bpe"], SpecialTokens(eos="<s>", pad="</s>"))
    manifest = Manifest.read(out)
    assert manifest.tokenizer == {**tokenizer.describe(), "path": "tokenizer"} and manifest.pad_id == tokenizer.pad_id
    paragraphs = [p for p in corpus.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    assert sorted(_documents(out, tokenizer)) == sorted(paragraphs)  # exact: a byte-level BPE
    # The flags' roles are in no file beside the tokenizer.json: the shards keep the tokenizer
    # in OUT/tokenizer, where training finds it by its sha256.
    assert load_tokenizer(out / "tokenizer").sha256 == manifest.tokenizer["sha256"]
    assert load_tokenizer(files["bpe"]).sha256 != manifest.tokenizer["sha256"]
    again = run_unmask(args, installed=True)
    assert again.returncode == 0 and json.loads(again.stdout.strip().splitlines()[-1])["nothing_to_do"]


@pytest.mark.parametrize("kind", ["wordpiece", "unigram"])
def test_prep_with_other_model_types_counts_every_document(files, tmp_path, kind):
    corpus = _corpus(tmp_path)
    result = prep(PrepRequest(PrepConfig(inputs=(str(corpus),), seq_len=32), tmp_path / "out",
                              tokenizer=files[kind], progress=False))
    tokenizer = load_tokenizer(files[kind])
    paragraphs = [p for p in corpus.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    assert result.manifest.counts["documents"] == len(paragraphs)
    assert sum(s.tokens for s in result.manifest.splits.values()) == sum(
        len(ids) + 1 for ids in tokenizer.encode_batch(paragraphs))
    assert load_tokenizer(tmp_path / "out" / "tokenizer").sha256 == tokenizer.sha256  # kept with the shards


def test_no_eos_stops_unmask_prep_with_the_flag_to_give(tmp_path):
    path = byte_level_bpe(tmp_path / "tok" / "tokenizer.json", special_tokens=("<s>",))
    done = run_unmask(["prep", "--input", str(_corpus(tmp_path)), "--out", str(tmp_path / "o"),
                       "--seq-len", "16", "--tokenizer", str(path.parent)], installed=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"{path}: no end-of-sequence token" in done.stderr and "--eos-token TOKEN" in done.stderr


@needs_shared(GPT2_DIR / "encoder.json", GPT2_DIR / "vocab.bpe")
def test_gpt2_shards_are_the_same_with_either_encoder(tmp_path):
    """GPT-2 as a tokenizer.json runs the reference BPE; as encoder.json + vocab.bpe, tiktoken.
    The shards are byte-identical, so preps made before tiktoken stay valid."""
    corpus = _corpus(tmp_path)
    as_json = tmp_path / "gpt2-json" / "tokenizer.json"
    as_json.parent.mkdir()
    reference_gpt2().save(str(as_json))
    config = PrepConfig(inputs=(str(corpus),), seq_len=64, val_fraction=0.1, unit_bytes=16 << 10)
    manifests = {}
    # The reference's <|endoftext|> is in its vocabulary but not among its special tokens: named by flag.
    for name, tokenizer, special in (("tiktoken", GPT2_DIR, SpecialTokens()),
                                     ("reference", as_json, SpecialTokens(eos="<|endoftext|>"))):
        request = PrepRequest(config, tmp_path / name, tokenizer=tokenizer, special_tokens=special, progress=False)
        manifests[name] = prep(request).manifest
    shards = {name: [(s.path, s.sha256) for split in m.splits.values() for s in split.shards]
              for name, m in manifests.items()}
    assert shards["tiktoken"] == shards["reference"] and len(shards["tiktoken"]) >= 2
    for shard_path, _ in shards["tiktoken"]:
        assert (tmp_path / "tiktoken" / shard_path).read_bytes() == (tmp_path / "reference" / shard_path).read_bytes()
