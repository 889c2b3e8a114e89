"""The documents of the local lm-eval tasks in this directory, read from files on disk (the
``../shared/data`` layout, ``evaluation.bounds.datasets``): lm-eval calls these as the tasks'
``custom_dataset``, so nothing downloads.

Each function takes lm-eval's task metadata as keywords and reads ``data_dir`` from it (set by
``unmask lm-eval --data-dir DIR``, or by lm-eval's ``--metadata '{"data_dir": "DIR"}'``), else
from the environment variable ``UNMASK_DATA_DIR``. A missing directory or file is a
``UserError`` naming the path and where to get the file.
See docs/downstream.md#tasks-without-a-download.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

from common.errors import UserError
from evaluation.bounds.datasets import load_dataset

__all__ = ["DATA_DIR_ENV", "DATA_DIR_KEY", "lambada_openai", "ptb_word_order", "resolve_data_dir", "wikitext2"]

DATA_DIR_KEY = "data_dir"            # the metadata key
DATA_DIR_ENV = "UNMASK_DATA_DIR"     # the environment variable, when the metadata has none
SPLIT = "test"
# ptb_word_order: sentences of fewer words make a second half too short to shuffle meaningfully.
MIN_WORDS = 6
WORD_ORDER_SEED = 0
SHUFFLE_TRIES = 10   # a shuffle equal to the original is drawn again (then the sentence is left out)


def resolve_data_dir(metadata: dict[str, Any]) -> Path:
    """The data directory of a local task: the metadata's ``data_dir``, else $UNMASK_DATA_DIR."""
    value = metadata.get(DATA_DIR_KEY) or os.environ.get(DATA_DIR_ENV)
    if not value:
        raise UserError(f"the local lm-eval tasks read files laid out as ../shared/data: give unmask lm-eval "
                        f"--data-dir DIR, lm-eval --metadata '{{\"{DATA_DIR_KEY}\": \"DIR\"}}', or set {DATA_DIR_ENV}")
    return Path(value)


def _splits(rows: list[dict[str, Any]]):
    import datasets

    return datasets.DatasetDict({SPLIT: datasets.Dataset.from_list(rows)})


def lambada_openai(**metadata: Any):
    """LAMBADA's test passages exactly as OpenAI's GPT-2 file holds them (lm-eval's lambada_openai)."""
    dataset = load_dataset("lambada", resolve_data_dir(metadata), SPLIT, detokenizer="identity")
    return _splits([{"text": text} for text in dataset.documents])


def wikitext2(**metadata: Any):
    """WikiText-2's raw test articles, detokenized as ``unmask eval --datasets wikitext2`` reads them."""
    dataset = load_dataset("wikitext2", resolve_data_dir(metadata), SPLIT)
    return _splits([{"page": text} for text in dataset.documents])


def ptb_word_order(**metadata: Any):
    """PTB test sentences of at least ``MIN_WORDS`` words: the first half as context, the second
    half and the same words shuffled as the two choices, the true one at a random index."""
    dataset = load_dataset("ptb", resolve_data_dir(metadata), SPLIT, detokenizer="identity")
    rows = []
    for index, sentence in enumerate(dataset.documents):
        words = sentence.split()
        if len(words) < MIN_WORDS:
            continue
        head, tail = words[:len(words) // 2], words[len(words) // 2:]
        draw = random.Random(WORD_ORDER_SEED * 1_000_003 + index)
        shuffled = next((candidate for candidate in (draw.sample(tail, len(tail)) for _ in range(SHUFFLE_TRIES))
                         if candidate != tail), None)
        if shuffled is None:   # every shuffle is the sentence itself (repeated words)
            continue
        label = draw.randrange(2)
        choices = [" ".join(shuffled), " ".join(tail)] if label else [" ".join(tail), " ".join(shuffled)]
        rows.append({"context": " ".join(head), "choices": choices, "label": label})
    return _splits(rows)
