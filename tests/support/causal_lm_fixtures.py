"""Tiny Hugging Face causal LMs on disk, built here with transformers (random weights, nothing
downloaded): what ``save_pretrained`` writes plus a small byte-level BPE ``tokenizer.json``, for
the adaptation's tests; and transformers' own next-token logits of such a directory."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.tokenizer_fixtures import VOCAB_SIZE, byte_level_bpe

__all__ = ["FAMILIES", "VOCAB_SIZE", "hf_logits", "write_causal_lm"]

# Each family's config: 2 layers of width 32, 4 heads; Llama and Qwen2 with 2 key/value heads
# (grouped-query attention), Qwen2 with its query/key/value biases; the ids of the tokenizer's
# </s> (0) and <s> (1) as transformers' eos and bos.
FAMILIES = {
    "gpt2": {"n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, "bos_token_id": 1, "eos_token_id": 0},
    "llama": {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 0},
    "qwen2": {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 0},
}


def _model(family: str, seed: int, **overrides):
    import transformers  # the dev extra: only the tests that build a source need it

    config_class, model_class = {"gpt2": ("GPT2Config", "GPT2LMHeadModel"),
                                 "llama": ("LlamaConfig", "LlamaForCausalLM"),
                                 "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[family]
    config = getattr(transformers, config_class)(**{"vocab_size": VOCAB_SIZE, **FAMILIES[family], **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).float().eval()
    with torch.no_grad():  # transformers zeroes biases and sets norms to one: random ones test their mapping
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                parameter.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    return model


def write_causal_lm(directory: Path, family: str, seed: int = 0, **overrides) -> Path:
    """A tiny random ``family`` causal LM saved at ``directory`` with a tokenizer of VOCAB_SIZE
    tokens (its bos ``<s>``, its eos ``</s>``)."""
    model = _model(family, seed, **overrides)
    model.save_pretrained(directory)
    byte_level_bpe(directory / "tokenizer.json")
    return directory


def hf_logits(directory: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own logits [B, L, V] of the model saved at ``directory`` on ``ids`` [B, L]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits
