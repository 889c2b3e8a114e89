"""Zero-shot evaluation sets (``evaluation.bounds.datasets``): counts on the real files, the
generic readers, and the errors a user can fix. Their detokenizers: test_detokenizers."""

import csv
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.errors import UserError
from evaluation.bounds.datasets import DATASET_NAMES, FILE_SPLIT, load_dataset, load_text_file
from evaluation.bounds.detokenizers import (
    LAMBADA_GPT2_PREFIX,
    lambada_detokenize,
    lm1b_detokenize,
    wikitext_detokenize,
)
from tests.support.paths import (
    LAMBADA_DEV,
    LAMBADA_TEST,
    LM1B_TEST,
    PTB_TEST,
    SHARED,
    WIKI_TEST,
    WIKI_VALID,
    needs_shared,
    real_lines,
)

needs_data = needs_shared(SHARED)
# (dataset, split) -> (file, units, sha256); line counts and hashes from SOURCES.md, WikiText's
# 60 articles per split from the WikiText paper (checked independently below).
EXPECTED = {
    ("ptb", "test"): (PTB_TEST, 3761,
                      "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0"),
    ("ptb", "valid"): ("ptb/ptb.valid.txt", 3370,
                       "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2"),
    ("wikitext2", "test"): (WIKI_TEST, 60,
                            "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08"),
    ("wikitext2", "valid"): (WIKI_VALID, 60,
                             "4cd0f6876d07a413aa911261ff6d363c72d757d47f0fdd6015702014c89cb9c7"),
    ("lambada", "test"): (LAMBADA_TEST, 5153,
                          "4aa8d02cd17c719165fc8a7887fddd641f43fcafa4b1c806ca8abc31fabdb226"),
    ("lambada", "valid"): (LAMBADA_DEV, 4869,
                           "f5b0f1e38fcdad6a1cd3a17bee4b6932a28cd9c5f463ada970c61de0f8679f2f"),
    ("lm1b", "test"): (LM1B_TEST, 6075,
                       "265dccd51762253e20425c21ff6ddf09e6da2e11a365da399b0390eebb2d52c8"),
    ("ag_news", "test"): ("ag_news/test.csv", 7600,
                          "521465c2428ed7f02f8d6db6ffdd4b5447c1c701962353eb2c40d548c3c85699"),
}
# A heading line " = Title = " between two blank lines, counted on the whole text at once.
WIKITEXT_TITLE_BLOCK = re.compile(r"^ \n = (?!=)[^\n]* = \n \n", re.MULTILINE)


@pytest.fixture(scope="module")
def loaded():
    """Every real split, loaded once for the module."""
    return {(name, split): load_dataset(name, SHARED, split) for name, split in EXPECTED}


# ---------------------------------------------------------------- real files: counts
@needs_data
@pytest.mark.parametrize("key", list(EXPECTED), ids="-".join)
def test_unit_counts_and_protocol(loaded, key):
    relative, units, sha256 = EXPECTED[key]
    data = loaded[key]
    protocol = data.protocol()
    assert (len(data.documents), data.dropped_empty) == (units, 0)
    assert data.path == SHARED / relative
    assert protocol["sha256"] == sha256
    assert protocol["documents"] == units and protocol["split"] == key[1]
    assert protocol["utf8_bytes"] == sum(len(d.encode()) for d in data.documents)
    assert json.loads(json.dumps(protocol)) == protocol
    assert all(doc == doc.strip() and doc for doc in data.documents)


@needs_data
def test_line_datasets_keep_file_order(loaded):
    assert loaded["ptb", "test"].documents[0] == "no it wasn't black monday"
    assert loaded["lm1b", "test"].documents[-1] == lm1b_detokenize(real_lines(LM1B_TEST)[-1])
    first = json.loads(real_lines(LAMBADA_TEST)[0])["text"]
    assert loaded["lambada", "test"].documents[0] == lambada_detokenize(first)


@needs_data
@pytest.mark.parametrize("relative", [WIKI_TEST, WIKI_VALID])
def test_wikitext_articles_match_an_independent_heading_count(loaded, relative):
    text = (SHARED / relative).read_text(encoding="utf-8")
    titles = WIKITEXT_TITLE_BLOCK.findall(text)
    split = "test" if relative == WIKI_TEST else "valid"
    documents = loaded["wikitext2", split].documents
    assert len(titles) == len(documents) == 60
    assert [doc.split("\n")[0] for doc in documents] == [
        wikitext_detokenize(title.split("\n")[1]) for title in titles]


@needs_data
def test_wikitext_equation_lines_are_not_headings(loaded):
    """Two " = ... = " lines of the test set are a paragraph broken at an equation."""
    loose = [line for line in real_lines(WIKI_TEST) if re.match(r"^ = [^=].* = $", line)]
    assert len(loose) == 62
    documents = loaded["wikitext2", "test"].documents
    (article,) = [doc for doc in documents if doc.startswith("= Constant k filter =")]
    assert "\n= 1 henry and capacitance C =\n" in article


@needs_data
def test_wikitext103_reads_the_same_text_as_wikitext2(loaded):
    for split in ("test", "valid"):
        wt103 = load_dataset("wikitext103", SHARED, split)
        assert wt103.documents == loaded["wikitext2", split].documents
        assert wt103.protocol()["sha256"] == loaded["wikitext2", split].protocol()["sha256"]
        assert wt103.name == "wikitext103"


@needs_data
def test_wikitext_article_text(loaded):
    first = loaded["wikitext2", "test"].documents[0]
    assert first.startswith("= Robert Boulter =\n\nRobert Boulter is an English film, television "
                            "and theatre actor. He had a guest-starring role on the television "
                            "series The Bill in 2000.")
    # Section headings joined up; the en dash of "2000 – 2005" is not a WikiText token.
    assert "\n\n== Career ==\n\n\n=== 2000 \N{EN DASH} 2005 ===\n\nIn 2000 Boulter" in first


@needs_data
def test_lambada_gpt2_detokenizer_override():
    data = load_dataset("lambada", SHARED, detokenizer="lambada_gpt2")
    assert data.detokenizer == data.protocol()["detokenizer"] == "lambada_gpt2"
    assert all(doc.startswith(LAMBADA_GPT2_PREFIX) for doc in data.documents)
    assert data.documents[0] == "\n" + load_dataset("lambada", SHARED).documents[0]


# ---------------------------------------------------------------- errors
def test_unknown_dataset_names_the_valid_ones(tmp_path):
    with pytest.raises(UserError, match="unknown evaluation dataset 'wikitext'") as err:
        load_dataset("wikitext", tmp_path)
    assert all(name in str(err.value) for name in DATASET_NAMES)


def test_unknown_split_names_the_valid_ones(tmp_path):
    with pytest.raises(UserError, match="ptb has no split 'train'; valid splits: test, valid"):
        load_dataset("ptb", tmp_path, "train")
    with pytest.raises(UserError, match="lm1b has no split 'valid'; valid splits: test$"):
        load_dataset("lm1b", tmp_path, "valid")


@pytest.mark.parametrize("name, relative, section", [
    ("ptb", PTB_TEST, "section 1 (Penn Treebank)"),
    ("wikitext103", WIKI_TEST, "sections 2b and 3"),
    ("lambada", LAMBADA_TEST, "section 4 (LAMBADA)"),
    ("lm1b", LM1B_TEST, "section 5 (One Billion Word)"),
])
def test_missing_file_names_the_path_and_the_source(tmp_path, name, relative, section):
    with pytest.raises(UserError) as err:
        load_dataset(name, tmp_path)
    message = str(err.value)
    assert str(tmp_path / relative) in message
    assert f"SOURCES.md {section}" in message


def test_non_utf8_dataset_file_names_file_and_line(tmp_path):
    path = tmp_path / PTB_TEST
    path.parent.mkdir()
    path.write_bytes(b" one line \n two line \n caf\xe9 \n")
    with pytest.raises(UserError, match=re.escape(f"{path} line 3: byte 26 is not UTF-8")):
        load_dataset("ptb", tmp_path)


def test_non_utf8_text_file_names_file_and_line(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"fine\n\n\xff\xfe broken\n")
    with pytest.raises(UserError, match=re.escape(f"{path} line 3:")):
        load_text_file(path)


def test_dataset_empty_after_detokenizing(tmp_path):
    path = tmp_path / PTB_TEST
    path.parent.mkdir()
    path.write_text(" \n  \n \n")
    with pytest.raises(UserError, match="no text left after detokenizing with 'ptb'"):
        load_dataset("ptb", tmp_path)


def test_empty_units_are_dropped_and_counted(tmp_path):
    path = tmp_path / PTB_TEST
    path.parent.mkdir()
    path.write_text(" a b \n \n c N d \n")
    data = load_dataset("ptb", tmp_path)
    assert data.documents == ["a b", "c 1 d"]
    assert data.protocol()["dropped_empty"] == 1


# ---------------------------------------------------------------- generic files
def test_text_file_paragraphs(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes("\ufeffFirst para\r\nstill first\r\n\r\n \r\n\r\nSecond  para\n".encode())
    data = load_text_file(path)
    assert data.documents == ["First para\nstill first", "Second  para"]
    assert (data.name, data.split, data.detokenizer) == (str(path), FILE_SPLIT, "identity")
    assert data.protocol()["unit"] == "paragraph (blank-line separated)"
    assert data.utf8_bytes == len("First para\nstill first") + len("Second  para")


def test_jsonl_file_field_and_detokenizer(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text('{"body": "it was n\'t me"}\n\n{"body": "you \'re here"}\n')
    data = load_text_file(path, text_field="body", detokenizer="ptb")
    assert data.documents == ["it wasn't me", "you 're here"]
    assert data.protocol()["unit"] == "record per JSON line (field 'body')"


@pytest.mark.parametrize("content, message", [
    ('{"text": "ok"}\n{"text": \n', "line 2: not valid JSON (Expecting value at column 10)"),
    ('{"text": "o\n', "line 1: not valid JSON (Unterminated string starting at column 10)"),
    ('{"text": "ok"}\n{"other": "x"}\n', "line 2: no field 'text'"),
    ('["text"]\n', "line 1: no field 'text'"),
    ('{"text": 3}\n', "line 1: field 'text' is int, not a string"),
])
def test_jsonl_errors_name_the_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(UserError, match=re.escape(f"{path} {message}")):
        load_text_file(path)


def test_parquet_file_column(tmp_path):
    path = tmp_path / "set.parquet"
    pq.write_table(pa.table({"id": [1, 2, 3], "content": ["a , b", "", "c ."]}), path)
    data = load_text_file(path, text_field="content", detokenizer="lm1b")
    assert data.documents == ["a, b", "c ."]
    assert data.dropped_empty == 1
    assert data.protocol()["unit"] == "row (column 'content')"


def test_parquet_binary_column_must_be_utf8(tmp_path):
    path = tmp_path / "set.parquet"
    pq.write_table(pa.table({"text": pa.array([b"fine", b"\xff"], pa.binary())}), path)
    message = f"{path} row 1 (from 0): column 'text' is not UTF-8"
    with pytest.raises(UserError, match=re.escape(message)):
        load_text_file(path)


def test_parquet_missing_column_lists_the_columns(tmp_path):
    path = tmp_path / "set.parquet"
    pq.write_table(pa.table({"body": ["x"]}), path)
    with pytest.raises(UserError, match=re.escape("no column 'text'; columns are ['body']")):
        load_text_file(path)


def test_generic_reader_errors(tmp_path):
    with pytest.raises(UserError, match=re.escape("unsupported evaluation file type '.csv'")):
        load_text_file(tmp_path / "set.csv")
    with pytest.raises(UserError, match="unknown detokenizer 'moses'; choose one of identity"):
        load_text_file(tmp_path / "set.txt", detokenizer="moses")
    with pytest.raises(UserError, match=re.escape(f"{tmp_path / 'set.txt'}: evaluation file does "
                                                  "not exist")):
        load_text_file(tmp_path / "set.txt")
    (tmp_path / "fake.parquet").write_text("not parquet")
    with pytest.raises(UserError, match="not a readable Parquet file"):
        load_text_file(tmp_path / "fake.parquet")


@pytest.mark.parametrize("text", [
    "first line\n\xa0\nsecond\n\n\u3000\nthird\n",     # lines of Unicode-only whitespace are text
    "a\n \t\nb\r\n\r\nc\n\n\n d \n",                    # ASCII-whitespace lines separate paragraphs
])
def test_a_text_file_splits_into_the_paragraphs_prep_reads(tmp_path, text):
    """One definition of a blank line: the evaluation datasets and `unmask prep` agree."""
    from data_prep.readers import ReadCounters, ReadOptions, plan_units, read_unit, resolve_inputs

    path = tmp_path / "doc.txt"
    path.write_bytes(text.encode("utf-8"))
    options = ReadOptions()
    prepped = [piece.text for unit in plan_units(resolve_inputs([str(path)]), options)
               for piece in read_unit(unit, options, ReadCounters())]
    assert load_text_file(path).documents == prepped


# ---------------------------------------------------------------- AG News, PubMed, ArXiv: formats
def _ag_news_hf_text(path) -> list[str]:
    """HF ag_news's ``text``, re-stated from its builder: its csv dialect, title + " " + description."""
    with open(path, encoding="utf-8", newline="") as stream:
        rows = csv.reader(stream, quotechar='"', delimiter=",", quoting=csv.QUOTE_ALL, skipinitialspace=True)
        return [f"{title} {description}" for _, title, description in rows]


@needs_data
def test_ag_news_items_are_hf_s_text_from_the_csv_or_a_parquet_of_the_split(loaded, tmp_path):
    hf_text = _ag_news_hf_text(SHARED / "ag_news/test.csv")
    rows = load_dataset("ag_news", SHARED, "test", rows=True, detokenizer="identity")  # the MDLM line's reading
    assert rows.documents == hf_text  # the rows the MDLM-line code reads, untouched
    assert loaded[("ag_news", "test")].documents == [text.strip() for text in hf_text]
    assert sum(len(text.encode()) for text in hf_text) == 1_788_274  # HF's num_bytes, less labels and offsets
    (tmp_path / "ag_news").mkdir()
    pq.write_table(pa.table({"text": hf_text, "label": [0] * len(hf_text)}), tmp_path / "ag_news/test.parquet")
    assert load_dataset("ag_news", tmp_path, "test", rows=True, detokenizer="identity").documents == hf_text


@pytest.mark.parametrize("content, message", [
    ('"3","a title"\n', r"ag_news/test.csv line 1: 2 fields, expected 3 \(class index, title, description\)"),
    ('"3","t","d"\n"9","t","d"\n', r"ag_news/test.csv line 2: class index '9' is not 1-4: not AG News's CSV"),
])
def test_a_malformed_ag_news_csv_names_the_line_and_the_format(tmp_path, content, message):
    (tmp_path / "ag_news").mkdir()
    (tmp_path / "ag_news/test.csv").write_text(content, encoding="utf-8")
    with pytest.raises(UserError, match=message):
        load_dataset("ag_news", tmp_path, "test")


def test_a_header_line_of_an_ag_news_csv_is_skipped(tmp_path):
    (tmp_path / "ag_news").mkdir()
    (tmp_path / "ag_news/test.csv").write_text('"Class Index","Title","Description"\n"2","A","b c"\n')
    assert load_dataset("ag_news", tmp_path, "test").documents == ["A b c"]


@pytest.mark.parametrize("name", ["pubmed", "arxiv"])
def test_a_release_file_of_the_scientific_papers_joins_each_article_s_sentences(tmp_path, name):
    (tmp_path / name).mkdir()
    lines = [{"article_id": "1", "article_text": ["first sentence .", "second one ."], "abstract_text": ["<S> a </S>"]},
             {"article_id": "2", "article_text": [], "abstract_text": []}]
    (tmp_path / name / "val.txt").write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    data = load_dataset(name, tmp_path, "valid", rows=True, detokenizer="identity")
    assert data.documents == ["first sentence .\nsecond one .", ""]  # an empty article is a row, kept
    assert load_dataset(name, tmp_path, "valid").documents == ["first sentence.\nsecond one."]


@pytest.mark.parametrize("content, message", [
    ('{"article_id": "1", "abstract_text": []}\n',
     "pubmed/val.txt line 1: field 'article_text' is missing, not a list of strings: not the release's val.txt"),
    ('{"article_text": "one string"}\n', "line 1: field 'article_text' is a str, not a list of strings"),
    ('{"article_text": ["a"]}\nnot json\n', "pubmed/val.txt line 2: not valid JSON .*\\('article_text': a list of"),
])
def test_a_malformed_release_file_names_the_line_and_the_format(tmp_path, content, message):
    (tmp_path / "pubmed").mkdir()
    (tmp_path / "pubmed/val.txt").write_text(content, encoding="utf-8")
    with pytest.raises(UserError, match=message):
        load_dataset("pubmed", tmp_path, "valid")


def test_a_parquet_without_the_article_column_names_the_split_it_should_be(tmp_path):
    (tmp_path / "arxiv").mkdir()
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "arxiv/validation.parquet")
    with pytest.raises(UserError, match=re.escape("no column 'article'; columns are ['text']; not a parquet of "
                                                  "Hugging Face's scientific_papers/arxiv validation split")):
        load_dataset("arxiv", tmp_path, "valid")


@pytest.mark.parametrize("name, split, files", [
    ("ag_news", "test", ("ag_news/test.csv (AG News's CSV", "ag_news/test.parquet (a parquet")),
    ("pubmed", "valid", ("pubmed/val.txt or", "pubmed/pubmed-dataset/val.txt (the release's val.txt",
                         "pubmed/validation.parquet", "pubmed-dataset.zip")),
    ("arxiv", "test", ("arxiv/test.txt or", "arxiv/arxiv-dataset/test.txt", "arxiv/test.parquet")),
])
def test_a_missing_set_names_every_file_it_may_be_read_from_and_where_to_get_it(tmp_path, name, split, files):
    with pytest.raises(UserError) as err:
        load_dataset(name, tmp_path, split)
    message = str(err.value)
    assert message.startswith(f"{name} {split}: expected {tmp_path / name}") and "\n" not in message
    for text in files:
        assert text in message
