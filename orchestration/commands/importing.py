"""``unmask import``: models released by other codebases, as unmask exports (``pipeline.interchange.mdlm_import``,
``pipeline.interchange.bd3lm_import``)."""

from __future__ import annotations

import argparse

RAW = argparse.RawDescriptionHelpFormatter

MDLM_EPILOG = """\
SOURCE is either of MDLM's layouts, with files you downloaded (nothing is downloaded here):
  a Hugging Face directory   config.json (model_type mdlm) and model.safetensors, e.g. kuleshov-group/mdlm-owt
  a Lightning .ckpt          of MDLM's training code: the EMA weights by default, --weights model for the live ones
The .ckpt's pickled objects (hyper-parameters, tokenizer) are read as inert records: none of their code runs.

examples:
  unmask import mdlm mdlm-owt/ --tokenizer ../shared/data/gpt2-bpe --out mdlm-export/
  unmask import mdlm mdlm.ckpt --tokenizer ../shared/data/gpt2-bpe --out mdlm-export/ --weights model
  unmask eval mdlm-export/ --datasets wikitext2,ptb --data-dir ../shared/data
"""


BD3LM_EPILOG = """\
SOURCE is BD3-LM's Hugging Face directory, with files you downloaded (nothing is downloaded here):
config.json (model_type bd3lm) and model.safetensors, e.g. kuleshov-group/bd3lm-owt-block_size4 (8, 16).
The export is block diffusion at the model's block_size; eval, sample and lm-eval use it block by block.

examples:
  unmask import bd3lm bd3lm-owt-block_size4/ --tokenizer ../shared/data/gpt2-bpe --out bd3lm-export/
  unmask eval bd3lm-export/ --datasets wikitext2,ptb --data-dir ../shared/data
  unmask sample bd3lm-export/ --num 2 --until-eos
"""


def _cmd_import_mdlm(args: argparse.Namespace) -> int:
    from pipeline.interchange.mdlm_import import import_mdlm

    out = import_mdlm(args.source, args.tokenizer, args.out, weights=args.weights)
    print(f"imported MDLM's model from {args.source} to {out}")
    return 0


def _cmd_import_bd3lm(args: argparse.Namespace) -> int:
    from pipeline.interchange.bd3lm_import import import_bd3lm

    out = import_bd3lm(args.source, args.tokenizer, args.out)
    print(f"imported BD3-LM's model from {args.source} to {out}")
    return 0


def _common_arguments(parser: argparse.ArgumentParser, codebase: str, source_help: str) -> None:
    """SOURCE, --tokenizer and --out, which every codebase's import takes."""
    parser.add_argument("source", metavar="SOURCE", help=source_help)
    parser.add_argument("--tokenizer", required=True, metavar="DIR",
                        help=f"the model's tokenizer: GPT-2's BPE (encoder.json + vocab.bpe) for {codebase}'s "
                             "OpenWebText models")
    parser.add_argument("--out", required=True, help="the export directory to write: new or empty, or an earlier "
                                                     "export")


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``import`` to the ``unmask`` command."""
    parser = commands.add_parser("import", help="turn another codebase's released model into an unmask export",
                                 description="Write an unmask export (what eval, sample and load_export read) "
                                             "of a model released by another codebase.",
                                 epilog="examples:\n  unmask import mdlm mdlm-owt/ --tokenizer gpt2-bpe/ --out "
                                        "mdlm-export/\n  unmask import bd3lm bd3lm-owt-block_size4/ --tokenizer "
                                        "gpt2-bpe/ --out bd3lm-export/", formatter_class=RAW)
    codebases = parser.add_subparsers(dest="codebase", metavar="CODEBASE", required=True)
    mdlm = codebases.add_parser(
        "mdlm", help="MDLM (Sahoo et al. 2024): its Hugging Face directory or a Lightning .ckpt",
        description="Import MDLM's DiT with its exact logits: the network gets the options that reproduce "
                    "it (biases, an untied head with the mask's row, adaLN from sigma, MDLM's rotary "
                    "rounding) and the export MDLM's log-linear schedule. A vocabulary, shape or tensor "
                    "that does not fit is refused, naming it.",
        epilog=MDLM_EPILOG, formatter_class=RAW)
    _common_arguments(mdlm, "MDLM", "MDLM's Hugging Face directory, or a .ckpt file")
    mdlm.add_argument("--weights", choices=["ema", "model"],
                      help="of a .ckpt: ema (default) or model (the live weights)")
    mdlm.set_defaults(handler=_cmd_import_mdlm)
    bd3lm = codebases.add_parser(
        "bd3lm", help="BD3-LM (Arriola et al. 2025): its Hugging Face directory",
        description="Import BD3-LM's block-diffusion DiT with its exact logits: MDLM's DiT options (biases, an "
                    "untied head with the mask's row, adaLN, the rotary rounding), BD3-LM's block mask over "
                    "[x_t ; x_0] at its block size, and its log-linear schedule. An option unmask's block model "
                    "cannot compute exactly (cross_attn false, causal, time conditioning), a vocabulary, shape "
                    "or tensor that does not fit is refused, naming it.",
        epilog=BD3LM_EPILOG, formatter_class=RAW)
    _common_arguments(bd3lm, "BD3-LM", "BD3-LM's Hugging Face directory")
    bd3lm.set_defaults(handler=_cmd_import_bd3lm)
