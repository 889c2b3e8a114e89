"""A GPT-2 causal LM of one of our presets' shapes, with random weights, written as transformers'
``save_pretrained`` writes it: what the GPU check adapts in place of GPT-2 medium (nothing is
downloaded on the device). Its ``tokenizer.json`` is GPT-2's byte-level BPE built by the
``tokenizers`` library from OpenAI's ``encoder.json`` and ``vocab.bpe`` (the same ids as
unmask's GPT-2 BPE tokenizer; prep the data with it: ``--init-from`` checks the tokenizer), or
a copy of the ``tokenizer.json`` given (shards prepped with one keep it in their ``tokenizer/``).
The position table has the context's rows (GPT-2 medium: 1,024); adapting grows it by the
start row as for the real model (docs/adapting.md).

    python bench/gpt2_source.py --preset medium --seq-len 1024 --tokenizer .gpu/tokenizer --out DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_prep.tokenizer.gpt2_bpe import GPT2_ENCODER_FILE, GPT2_MERGES_FILE  # noqa: E402
from data_prep.tokenizer.hugging_face import TOKENIZER_JSON_FILE  # noqa: E402
from model.transformer import PRESETS  # noqa: E402

EOS = "<|endoftext|>"   # GPT-2's one special token, id 50256: its bos and eos


def write_gpt2_tokenizer(bpe_dir: Path, path: Path) -> int:
    """GPT-2's BPE of ``bpe_dir`` (encoder.json, vocab.bpe) as a tokenizer.json at ``path``; its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    encoder = json.loads((bpe_dir / GPT2_ENCODER_FILE).read_text(encoding="utf-8"))
    lines = (bpe_dir / GPT2_MERGES_FILE).read_text(encoding="utf-8").split("\n")[1:]  # after the version line
    tokenizer = Tokenizer(models.BPE(vocab=encoder, merges=[tuple(line.split(" ")) for line in lines if line]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS])
    tokenizer.save(str(path))
    return tokenizer.get_vocab_size()


def _write_tokenizer(tokenizer: Path, path: Path) -> int:
    """``tokenizer`` (GPT-2's BPE directory, a tokenizer.json or a directory with one) at ``path``; its size."""
    from tokenizers import Tokenizer

    if (tokenizer / GPT2_ENCODER_FILE).is_file():
        return write_gpt2_tokenizer(tokenizer, path)
    given = tokenizer / TOKENIZER_JSON_FILE if tokenizer.is_dir() else tokenizer
    shutil.copyfile(given, path)
    return Tokenizer.from_file(str(path)).get_vocab_size()


def write_gpt2_source(out: Path, preset: str, seq_len: int, tokenizer: Path, seed: int = 0) -> Path:
    """A random GPT2LMHeadModel of ``preset``'s layers, width and heads, ``seq_len`` positions, at
    ``out``, with ``tokenizer`` (see ``_write_tokenizer``); its eos the tokenizer's last id."""
    import transformers  # the dev extra, and the device kit's

    out.mkdir(parents=True, exist_ok=True)
    vocab_size = _write_tokenizer(tokenizer, out / TOKENIZER_JSON_FILE)
    shape = PRESETS[preset]
    eos = vocab_size - 1
    config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=seq_len, n_embd=shape["d_model"],
                                     n_layer=shape["n_layers"], n_head=shape["n_heads"], bos_token_id=eos,
                                     eos_token_id=eos)
    torch.manual_seed(seed)
    transformers.GPT2LMHeadModel(config).save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="medium", choices=sorted(PRESETS))
    parser.add_argument("--seq-len", type=int, default=1024, help="position rows (GPT-2: 1024)")
    parser.add_argument("--tokenizer", required=True, help="a directory with GPT-2's encoder.json and vocab.bpe, "
                        "or a tokenizer.json (or a directory with one)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    print(write_gpt2_source(Path(args.out), args.preset, args.seq_len, Path(args.tokenizer)))


if __name__ == "__main__":
    main()
