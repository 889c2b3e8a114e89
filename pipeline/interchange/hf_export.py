"""The Hugging Face format: a model as a directory that transformers loads (``write_hf_export``).

    OUT/config.json           model_type "unmask", auto_map to the modeling file, the network's
                              fields (``network``), the unmask export's config (``unmask``) and,
                              for a block diffusion model, its ``block_size``
    OUT/model.safetensors     the network's float32 weights, under the names of unmask's Transformer
    OUT/modeling_unmask.py    the network for transformers (``pipeline/interchange/hf_modeling``): torch only
    OUT/<tokenizer files>     the tokenizer's own files, and transformers' files where they
                              give the same ids (GPT-2's BPE, a tokenizer.json)

``AutoModelForMaskedLM.from_pretrained(OUT, trust_remote_code=True)`` gives the logits of
``pipeline.interchange.export.load_export`` on the same input. The directory appears whole and
replaces only an earlier one of its kind (``HF_EXPORT_KIND``, ``common.outputs``). The
manual: docs/import-export.md, "Hugging Face format".
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.atomic_files import atomic_write_bytes
from common.outputs import OutputKind, new_output_dir
from data_prep.tokenizer.base import Tokenizer
from data_prep.tokenizer.gpt2_bpe import GPT2_ENCODER_FILE, GPT2_EOS_TOKEN, GPT2_MERGES_FILE
from data_prep.tokenizer.load import load_tokenizer
from model.spec import ModelSpec, build_network

__all__ = ["HF_EXPORT_KIND", "HF_MODELING_FILE", "HF_MODEL_TYPE", "write_hf_export"]

HF_MODEL_TYPE = "unmask"
HF_MODELING_FILE = "modeling_unmask.py"
HF_CONFIG_FILE = "config.json"
HF_WEIGHTS_FILE = "model.safetensors"
HF_TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_MODELING_SOURCE = Path(__file__).with_name("hf_modeling") / HF_MODELING_FILE
_MODULE = HF_MODELING_FILE.removesuffix(".py")
AUTO_MAP = {"AutoConfig": f"{_MODULE}.UnmaskConfig", "AutoModelForMaskedLM": f"{_MODULE}.UnmaskForMaskedLM"}
# transformers' names for GPT-2's two files (the same bytes as OpenAI's encoder.json and vocab.bpe).
HF_GPT2_VOCAB_FILE, HF_GPT2_MERGES_FILE = "vocab.json", "merges.txt"

# What `unmask export --format hf` writes: a directory that appears whole.
HF_EXPORT_KIND = OutputKind("hf-export", "a transformers directory of `unmask export --format hf`", whole=True)


def write_hf_export(out: Path, tensors: Mapping[str, torch.Tensor], config: dict, tokenizer_dir: Path) -> None:
    """Write the transformers directory ``out`` of the model whose unmask export would hold
    ``tensors``, ``config`` (its config.json) and the tokenizer in ``tokenizer_dir``. It
    appears whole or not at all. Tensors that are not the network's (a learned schedule's)
    stay in the unmask export only."""
    spec = ModelSpec.from_dict(config)
    with new_output_dir(out, HF_EXPORT_KIND, "--out") as staging:
        save_file(_network_weights(tensors, spec), str(staging / HF_WEIGHTS_FILE), metadata={"format": "pt"})
        shutil.copyfile(_MODELING_SOURCE, staging / HF_MODELING_FILE)
        hf_config = {"model_type": HF_MODEL_TYPE, "architectures": ["UnmaskForMaskedLM"], "auto_map": AUTO_MAP,
                     "network": asdict(spec.network), "unmask": config, "dtype": "float32",
                     "tie_word_embeddings": False}
        if spec.block_size is not None:  # its forward then takes the clean copy too (the modeling file's docstring)
            hf_config["block_size"] = spec.block_size
        atomic_write_bytes(staging / HF_CONFIG_FILE, json.dumps(hf_config, indent=2, sort_keys=True).encode())
        _write_tokenizer(staging, load_tokenizer(tokenizer_dir), spec.network.max_seq_len)


def _network_weights(tensors: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    with torch.device("meta"):  # the names and shapes, without allocating or initialising
        expected = build_network(spec).state_dict()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"the weights lack the network's {missing[:5]}")
    return {name: tensors[name].float().contiguous() for name in expected}


def _write_tokenizer(directory: Path, tokenizer: Tokenizer, max_length: int) -> None:
    """The tokenizer's own files, and transformers' files for the kinds it reads exactly."""
    tokenizer.save(directory)
    settings: dict = {"model_max_length": max_length}
    if tokenizer.kind == "gpt2-bpe":
        shutil.copyfile(directory / GPT2_ENCODER_FILE, directory / HF_GPT2_VOCAB_FILE)
        shutil.copyfile(directory / GPT2_MERGES_FILE, directory / HF_GPT2_MERGES_FILE)
        settings.update(tokenizer_class="GPT2Tokenizer", add_prefix_space=False, eos_token=GPT2_EOS_TOKEN,
                        bos_token=GPT2_EOS_TOKEN, unk_token=GPT2_EOS_TOKEN)
    elif tokenizer.kind == "tokenizer-json":
        settings.update(tokenizer_class="PreTrainedTokenizerFast",
                        **{f"{role}_token": token for role, token in tokenizer.roles.items()})
    else:
        return
    atomic_write_bytes(directory / HF_TOKENIZER_CONFIG_FILE, json.dumps(settings, indent=2, sort_keys=True).encode())
