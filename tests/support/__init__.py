"""What the tests share: helpers, builders of fixtures, real servers on 127.0.0.1. Test modules
import from here, never from ``tests/conftest.py`` (which holds pytest's hooks and fixtures).

Where things are and how to run them:

- ``paths``: this checkout and the real data in ``../shared/data`` (skip when absent), the
  evaluation sets' files.
- ``cli_runner``: ``unmask`` as a user runs it (a subprocess, torchrun) or in this process.
- ``train_helpers``: tinyshakespeare's shards, micro configs, real training runs (``Run``).
- Runners with a hook, started as ``python -m tests.support.NAME``: ``stall`` (a training run
  stalls after step N), ``prep_stall`` (a prep stalls at N ledger entries), ``startup_signal``
  (SIGTERM while a training command starts up), ``batch_log`` (every micro-batch logged).

What the math is checked against:

- ``oracle``: an enumerable distribution with its exact conditionals, bounds and sampler laws.
- ``stats``: z-scores, chi-square and its limit, total variation.
- ``denoisers``: arbitrary and constant denoisers that record their calls.
- ``fake_device``: a pretend accelerator on CPU with CUDA's device rules, and ``OnDevice``.

Files the code reads, built here:

- ``export_fixtures``: exports of untrained small networks (and the text of the device tests').
- ``shard_fixtures``: numbered synthetic shards; a prep's bytes for comparing two preps.
- ``readers``: a corpus read as the prep reads it, and the plain statement of the text formats.
- ``tokenizer_fixtures``: GPT-2's reference BPE and small tokenizer.json files; the corpus and
  sizes of the shared SentencePiece models.
- ``results_fixtures``: the JSON of a results.json and a downstream.json.
- ``mdlm_reference``: MDLM's DiT written independently, and its checkpoints from random weights.
- ``bd3lm_fixtures``: BD3-LM's fixtures (``tests/fixtures/bd3lm``) and their tokenizer.
- ``upload_fixtures``: a working directory seeded with code, secrets and ignored files.

Servers: ``mlflow_server`` (a pytest plugin, ``tests/conftest.py``), ``s3_server`` (moto),
``ray_head`` (``ray start --head``).
"""
