"""The detokenizers of the evaluation sets (``evaluation.bounds.detokenizers``): on real lines of
../shared/data, never doubling a space, deterministic; the registry and small cases."""

import json
import random

import pytest

from evaluation.bounds.detokenizers import (
    DETOKENIZERS,
    lambada_detokenize,
    lambada_plain_detokenize,
    lm1b_detokenize,
    ptb_detokenize,
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
    real_line,
    real_lines,
)

needs_data = needs_shared(SHARED)

# ---------------------------------------------------------------- detokenizers on real lines
REAL_LINE_CASES = [
    (WIKI_TEST, 1831, wikitext_detokenize,
     "Total: fifty-eight battalions, sixty-two squadrons, fourteen artillery batteries, "
     "approximately 24,000 men and 168 guns."),
    (WIKI_TEST, 3159, wikitext_detokenize,
     "The 2nd District (2015 population: 215,457) covers the eastern inland portion of Tondo, a "
     "neighborhood or sub-district known as Gagalangin."),
    (WIKI_TEST, 3842, wikitext_detokenize, "= Kirby's Block Ball ="),
    (PTB_TEST, 352, ptb_detokenize,
     "the spokesman said the broadcast unit will be ? dec. 1 and the move won't affect rjr's "
     "print radio and ? buying practices"),
    (PTB_TEST, 1943, ptb_detokenize,
     "? portfolio manager james craig wasn't ? when friday's rout ? $1 million from the value of "
     "the $1 million ? fund he oversees"),
    (PTB_TEST, 7, ptb_detokenize,
     "seven big board stocks ual amr bankamerica walt disney capital cities/abc philip morris and "
     "pacific telesis group stopped trading and never resumed"),
    (LM1B_TEST, 2, lm1b_detokenize,
     "Long before the advent of e-commerce, Wal-Mart's founder Sam Walton set out his vision for "
     "a successful retail operation: \"We let folks know we're interested in them and that "
     "they're vital to us-- ' cause they are,\" he said."),
    (LM1B_TEST, 23, lm1b_detokenize,
     "Under the terms of the agreement, Gifford was paid an annual consulting fee of $50,000 and "
     "entitled to 120 hours per year of flying time on a corporate jet provided by BofA."),
    # The reference's "." rule needs a word before the stop, so ") ." keeps its space.
    (LM1B_TEST, 42, lm1b_detokenize,
     "Goalkeepers: Iker Casillas (Real Madrid), Jose Reina (Liverpool) ."),
    (LAMBADA_DEV, 3, lambada_plain_detokenize,
     "my assessment of being dead before lunch wasn't too far off base. irritably, ezra shook his "
     "head, stalking toward \"our\" mat. \"what kind of training have you had?\" i gulped, and "
     "hurried to catch up. \"uh, none.\" \"perfect,\" he muttered, facing me on the mat"),
]


@needs_data
@pytest.mark.parametrize("relative, number, detokenize, expected", REAL_LINE_CASES,
                         ids=[f"{c[0].split('/')[0]}-{c[1]}" for c in REAL_LINE_CASES])
def test_detokenizer_on_real_line(relative, number, detokenize, expected):
    assert detokenize(real_line(relative, number)) == expected


@needs_data
def test_lambada_curly_double_quotes_become_ascii():
    passage = json.loads(real_line(LAMBADA_TEST, 7))["text"]
    assert passage.startswith("He heard Rhinna speak \N{LEFT DOUBLE QUOTATION MARK}The Queen")
    assert lambada_detokenize(passage) == (
        "He heard Rhinna speak \"The Queen wants you in her carriage.\" \nTom spoke \"No, "
        "I\N{RIGHT SINGLE QUOTATION MARK}m not going in some asylum.\" \nRan was seen standing "
        "next to him spoke \"It\N{RIGHT SINGLE QUOTATION MARK}s just for a private talk with you "
        "that\N{RIGHT SINGLE QUOTATION MARK}s all.\" \nTom groaned and went inside the carriage "
        "to sit down next to the Queen")


@needs_data
def test_lambada_latex_closing_quote_becomes_ascii():
    passage = json.loads(real_line(LAMBADA_TEST, 1725))["text"]
    assert "there.''" in passage
    assert "she said only, \"I ought to leave you there.\"\n" in lambada_detokenize(passage)


@needs_data
@pytest.mark.parametrize("relative, detokenizer", [
    (WIKI_TEST, "wikitext"), (WIKI_VALID, "wikitext"), (PTB_TEST, "ptb"), (LM1B_TEST, "lm1b"),
    (LAMBADA_DEV, "lambada_plain"), (LAMBADA_TEST, "lambada"),
])
def test_no_double_spaces_from_single_spaced_real_lines(relative, detokenizer):
    detokenize = DETOKENIZERS[detokenizer]
    lines = real_lines(relative)
    if relative == LAMBADA_TEST:
        lines = [json.loads(line)["text"] for line in lines]
    single_spaced = [line for line in lines if "  " not in line]
    assert len(single_spaced) > len(lines) // 2
    doubled = [line for line in single_spaced if "  " in detokenize(line)]
    assert doubled == []


# ---------------------------------------------------------------- detokenizer properties
TRICKY_TOKENS = [
    "the", "N", "s", "'s", "n't", "'", "''", "``", '"', "(", ")", "[", "]", "{", "}", "@-@",
    "@,@", "@.@", ".", ",", ":", ";", "?", "!", "/", "\\/", "$", "#", "1", "<unk>", "=", "= =",
    "\N{DEGREE SIGN}", "\N{POUND SIGN}", "http", "\N{LEFT DOUBLE QUOTATION MARK}",
    "\N{RIGHT DOUBLE QUOTATION MARK}", "word",
]


def random_single_spaced(rng: random.Random) -> str:
    words = rng.choices(TRICKY_TOKENS, k=rng.randint(1, 25))
    text = " ".join(words)
    return f" {text} " if rng.random() < 0.5 else text


@pytest.mark.parametrize("key", sorted(DETOKENIZERS))
def test_detokenizers_never_double_a_space_and_are_deterministic(key):
    detokenize = DETOKENIZERS[key]
    rng = random.Random(f"detok-{key}")
    for _ in range(2000):
        text = random_single_spaced(rng)
        out = detokenize(text)
        assert "  " not in out, (text, out)
        assert detokenize(text) == out


def test_detokenizer_registry_and_small_cases():
    assert set(DETOKENIZERS) == {"identity", "wikitext", "ptb", "lm1b", "lambada", "lambada_gpt2",
                                 "lambada_plain", "wikitext_mdlm", "lambada_mdlm", "ag_news", "scientific_papers",
                                 "scientific_papers_mdlm"}
    # MDLM's WikiText rules: a row keeps its leading space, loses the one before its newline, and
    # " N " reads as a number; its LAMBADA rule keeps a LaTeX-style quote.
    assert DETOKENIZERS["wikitext_mdlm"](" = = Career = = \n") == " == Career ==\n"
    assert DETOKENIZERS["wikitext_mdlm"](" Highway 19 N near 57 \N{DEGREE SIGN} N \n") == (
        " Highway 19 1 near 57\N{DEGREE SIGN}N\n")
    assert DETOKENIZERS["lambada_mdlm"]("  \N{LEFT DOUBLE QUOTATION MARK}hi'' ") == '\n"hi\'\''
    assert DETOKENIZERS["identity"](" a  b ") == " a  b "
    # WikiText: no " N " -> " 1 " (raw WikiText has real numbers), headings and degrees joined.
    assert wikitext_detokenize(" = = = N / A = = = \n") == "=== N / A ==="
    assert wikitext_detokenize(" 57 \N{DEGREE SIGN} N ") == "57\N{DEGREE SIGN}N"
    assert wikitext_detokenize(' he said " hello " . \n \n next line ') == (
        'he said "hello".\n\nnext line')
    # PTB: only a space-delimited N is a number, as in the reference.
    assert ptb_detokenize(" N years ago N N \n") == "N years ago 1 N"
    assert ptb_detokenize("the players ' union") == "the players' union"
    assert lm1b_detokenize("see http : / / example.com / a now !") == (
        "see http://example.com/a now!")
    assert DETOKENIZERS["lambada_gpt2"]("  ``hi''  ") == '\n"hi"'


def test_the_scientific_papers_detokenizers_ours_per_sentence_and_mdlm_s_on_the_whole_article():
    article = 'the ratio was 1 @.@ 5 times ( n = 30 ) , as " before " .\nwe set N = 4 , it \'s fine .'
    # Both: WikiText's rules, then 1BW's; ours keeps the variable N, MDLM's " N " -> " 1 " does not.
    assert DETOKENIZERS["scientific_papers"](article) == (
        'the ratio was 1.5 times (n = 30), as "before" .\nwe set N = 4, it\'s fine.')
    assert DETOKENIZERS["scientific_papers_mdlm"](article) == (
        'the ratio was 1.5 times (n = 30), as "before" .\nwe set 1 = 4, it\'s fine.')
    # Ours works sentence by sentence, each stripped; MDLM's pairs quotes across sentences and
    # anchors its end-of-sentence rules at the article's end only.
    sentences = ' first line . \n second " q \n more " . '
    assert DETOKENIZERS["scientific_papers"](sentences) == 'first line.\nsecond " q\nmore ".'
    assert DETOKENIZERS["scientific_papers_mdlm"](sentences) == ' first line.\nsecond "q\nmore". '
    assert DETOKENIZERS["ag_news"](" Wall St. Bears Claw Back  #39;s ") == "Wall St. Bears Claw Back  #39;s"
