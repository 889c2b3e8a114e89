"""lm-eval task configs that read local files (``local_data``): LAMBADA (OpenAI's test file),
WikiText-2's raw test articles, and a two-way multiple choice on the Penn Treebank's word order.
``unmask lm-eval`` always includes this directory; with lm-eval's own command line pass it as
``--include_path`` (``TASKS_DIR``)."""

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
