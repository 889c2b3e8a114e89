"""unmask's masked-diffusion denoiser for Hugging Face transformers (torch only, self-contained).

Written by ``unmask export --format hf`` beside ``config.json`` and ``model.safetensors``:

    from transformers import AutoModelForMaskedLM
    model = AutoModelForMaskedLM.from_pretrained(DIR, trust_remote_code=True).eval()
    logits = model(input_ids, t=t).logits      # [B, L, V] over the V clean tokens

``input_ids`` holds ids 0..V-1 and the mask id V (``config.mask_id``); ``t`` ([B], in [0, 1]) is
the diffusion time, required when ``config.network["time_conditioning"]``, ignored otherwise.
The logits never include the mask: softmax over them predicts the clean token at each
position. ``config.unmask`` holds the export's spec (process, schedule) and provenance.

A block diffusion model (``config.block_size`` L' set) also takes the clean copy x_0:

    logits = model(input_ids, clean_ids=x0).logits  # [B, L, V]: input_ids is x_t, clean_ids x_0

The logits of block b depend only on ``input_ids``' block b and ``clean_ids``' blocks before
it: to denoise block b after a generated prefix, put the prefix in ``clean_ids`` and block b's
noisy tokens in ``input_ids``. L must be a multiple of L', and ``t`` is ignored. A block model
called without ``clean_ids``, or another model with it, raises ValueError.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput

# The network fields this file implements; a network with any other is refused rather than
# computed wrong. (unmask's tests hold this list to model.transformer.TransformerConfig.)
NETWORK_FIELDS = (
    "vocab_size", "n_layers", "d_model", "n_heads", "max_seq_len", "mlp_ratio", "dropout", "time_conditioning",
    "time_embed_dim", "tie_weights", "causal", "rope_base", "norm_eps", "init_std", "mlp_bias", "head_bias",
    "head_mask_row", "adaptive_norm", "time_frequencies", "time_input", "rope_angles", "vocab_multiple",
    "shift", "family",
)
# Fields of a network adapted from an autoregressive model, at the values this file computes (an
# unmask network's): the others are refused.
ADAPTED_FIELDS = {"shift": False, "family": None}
MAX_TIME_PERIOD = 10_000.0  # periods of the sinusoidal time features span 1 to this many units
TIME_SCALE = 1000.0         # time input "scaled_t": TIME_SCALE * t
LOGLINEAR_SIGMA_EPS = 1e-3  # time input "loglinear_sigma": -log(1 - (1 - eps) t)


class UnmaskConfig(PretrainedConfig):
    """``network``: unmask's network fields; ``unmask``: the export's spec and provenance."""

    model_type = "unmask"

    def __init__(self, network: dict | None = None, unmask: dict | None = None, block_size: int | None = None,
                 **kwargs) -> None:
        self.network = dict(network or {})
        self.unmask = dict(unmask or {})
        self.block_size = block_size
        _check_block_size(block_size, self.network, self.unmask)
        unknown = sorted(set(self.network) - set(NETWORK_FIELDS))
        if unknown:
            raise ValueError(f"this modeling file does not know the network fields {unknown}: export again "
                             "with the unmask version that trained the model")
        adapted = sorted(name for name, value in ADAPTED_FIELDS.items() if self.network.get(name, value) != value)
        if adapted:
            raise ValueError(f"network {adapted[0]} = {self.network[adapted[0]]!r}: a model adapted from an "
                             "autoregressive one, which this file does not compute; use its unmask export")
        if self.network.get("vocab_multiple", 1) != 1:  # exports drop the padded vocabulary rows
            raise ValueError(f"network vocab_multiple = {self.network['vocab_multiple']}: this file takes the "
                             "weights of an export, whose vocabulary is unpadded (vocab_multiple 1)")
        kwargs.setdefault("tie_word_embeddings", False)  # the tied head reads the embedding itself
        super().__init__(**kwargs)

    @property
    def mask_id(self) -> int:
        """The mask's id: one past the V clean tokens."""
        return self.network["vocab_size"]


def _check_block_size(block_size: int | None, network: dict, spec: dict) -> None:
    """A block model's L': the export's own (``spec``, when there is one), a positive int, of a
    bidirectional time-free network."""
    if spec and block_size != spec.get("block_size"):  # a lost block_size would run one bidirectional pass
        raise ValueError(f"block_size {block_size} differs from the export's (unmask.block_size "
                         f"{spec.get('block_size')}): export again with unmask export --format hf")
    if block_size is None:
        return
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if network.get("causal") or network.get("time_conditioning"):
        raise ValueError("block diffusion runs a bidirectional network without time conditioning: "
                         "this config's network is causal or time-conditioned")


def block_diffusion_mask(length: int, block_size: int, device: torch.device) -> Tensor:
    """bool [2L, 2L] over the rows [x_t ; x_0], True where the query row attends the key row:
    noisy block b sees itself and clean blocks < b, clean block b clean blocks <= b."""
    row = torch.arange(2 * length, device=device)
    noisy, block = row < length, (row % length) // block_size  # [2L] each
    q_noisy, k_noisy, q_block, k_block = noisy[:, None], noisy[None, :], block[:, None], block[None, :]
    noisy_rows = q_noisy & ((k_noisy & (k_block == q_block)) | (~k_noisy & (k_block < q_block)))
    clean_rows = ~q_noisy & ~k_noisy & (k_block <= q_block)
    return noisy_rows | clean_rows


class LayerNorm(nn.Module):
    """A weight and no bias, in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), None, self.eps).type_as(x)


def rotary_tables(length: int, head_dim: int, base: float, angles_dtype: str, device: torch.device):
    """cos and sin [length, head_dim / 2] of the rotary angles, rounded as the network was trained."""
    if angles_dtype == "float32":
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
        angles = torch.outer(torch.arange(length, device=device).float(), inv_freq)
    else:
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
        angles = torch.outer(torch.arange(length, dtype=torch.float64, device=device), inv_freq)
    return angles.cos().float(), angles.sin().float()


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the pairs (i, i + head_dim / 2) of x [B, H, L, head_dim]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class SelfAttention(nn.Module):
    def __init__(self, net: dict) -> None:
        super().__init__()
        self.n_heads, self.causal = net["n_heads"], net["causal"]
        self.qkv = nn.Linear(net["d_model"], 3 * net["d_model"], bias=False)
        self.out = nn.Linear(net["d_model"], net["d_model"], bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None) -> Tensor:
        """x [B, rows, d]; ``mask`` (bool [rows, rows]) replaces the network's own full or causal attention."""
        batch, length, width = x.shape
        # [B, rows, 3 d] -> [3, B, heads, rows, head_dim]
        q, k, v = self.qkv(x).view(batch, length, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(batch, length, width))


class MLP(nn.Module):
    def __init__(self, net: dict) -> None:
        super().__init__()
        hidden = net["mlp_ratio"] * net["d_model"]
        self.up = nn.Linear(net["d_model"], hidden, bias=net["mlp_bias"])
        self.down = nn.Linear(hidden, net["d_model"], bias=net["mlp_bias"])

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale) + shift


def modulated(net: dict) -> bool:
    return net["time_conditioning"] or net["adaptive_norm"]


class Block(nn.Module):
    def __init__(self, net: dict) -> None:
        super().__init__()
        self.attn_norm = LayerNorm(net["d_model"], net["norm_eps"])
        self.attn = SelfAttention(net)
        self.mlp_norm = LayerNorm(net["d_model"], net["norm_eps"])
        self.mlp = MLP(net)
        self.modulation = nn.Linear(net["time_embed_dim"], 6 * net["d_model"]) if modulated(net) else None

    def forward(self, x: Tensor, cond: Tensor | None, cos: Tensor, sin: Tensor, mask: Tensor | None = None) -> Tensor:
        if self.modulation is None:
            x = x + self.attn(self.attn_norm(x), cos, sin, mask)
            return x + self.mlp(self.mlp_norm(x))
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(cond)[:, None].chunk(6, dim=-1)
        x = x + gate1 * self.attn(modulate(self.attn_norm(x), shift1, scale1), cos, sin, mask)
        return x + gate2 * self.mlp(modulate(self.mlp_norm(x), shift2, scale2))


class TimeEmbedding(nn.Module):
    def __init__(self, net: dict) -> None:
        super().__init__()
        dim = net["time_embed_dim"]
        self.frequencies, self.time_input = net["time_frequencies"] or dim, net["time_input"]
        self.mlp = nn.Sequential(nn.Linear(self.frequencies, dim), nn.SiLU(), nn.Linear(dim, dim), nn.SiLU())

    def forward(self, t: Tensor) -> Tensor:
        half = self.frequencies // 2
        freqs = torch.exp(-math.log(MAX_TIME_PERIOD) * torch.arange(half, device=t.device) / half)
        t = t.float()
        time = -torch.log1p(-(1 - LOGLINEAR_SIGMA_EPS) * t) if self.time_input == "loglinear_sigma" else TIME_SCALE * t
        angles = time[:, None] * freqs[None]
        features = torch.cat([angles.cos(), angles.sin()], dim=-1)
        if self.frequencies % 2:
            features = F.pad(features, (0, 1))
        return self.mlp(features.to(self.mlp[0].weight.dtype))


class UnmaskPreTrainedModel(PreTrainedModel):
    config_class = UnmaskConfig
    base_model_prefix = "unmask"

    def _init_weights(self, module: nn.Module) -> None:
        """unmask's initialisation, for weights a checkpoint lacks (GPT-2's, adaLN-zero)."""
        std = self.config.network.get("init_std", 0.02)
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, LayerNorm):
            nn.init.ones_(module.weight)


class UnmaskForMaskedLM(UnmaskPreTrainedModel):
    """The denoiser: ``(input_ids [B, L], t [B]) -> logits [B, L, V]``, a block model's with
    ``clean_ids`` [B, L] too; see the module docstring."""

    def __init__(self, config: UnmaskConfig) -> None:
        super().__init__(config)
        net = self.net = config.network
        d, v = net["d_model"], net["vocab_size"]
        self.embed = nn.Embedding(v + 1, d)
        self.time_embed = TimeEmbedding(net) if modulated(net) else None
        self.blocks = nn.ModuleList(Block(net) for _ in range(net["n_layers"]))
        self.final_norm = LayerNorm(d, net["norm_eps"])
        self.final_modulation = nn.Linear(net["time_embed_dim"], 2 * d) if modulated(net) else None
        self.head = None if net["tie_weights"] else nn.Linear(d, v + int(net["head_mask_row"]), bias=net["head_bias"])
        self.post_init()

    def forward(self, input_ids: Tensor, t: Tensor | None = None, clean_ids: Tensor | None = None,
                return_dict: bool | None = None, **_unused) -> MaskedLMOutput | tuple[Tensor]:
        net = self.net
        length = input_ids.shape[1]
        if length > net["max_seq_len"]:
            raise ValueError(f"sequence length {length} exceeds max_seq_len {net['max_seq_len']}")
        if net["time_conditioning"] and t is None:
            raise ValueError("this model is time-conditioned: pass t (the diffusion time of each sequence, in [0, 1])")
        mask = self._block_mask(input_ids, clean_ids)
        cond = None
        if self.time_embed is not None:
            time = t if net["time_conditioning"] else torch.zeros(input_ids.shape[0], device=input_ids.device)
            cond = self.time_embed(time.to(input_ids.device))
        cos, sin = rotary_tables(length, net["d_model"] // net["n_heads"], net["rope_base"], net["rope_angles"],
                                 input_ids.device)
        if mask is not None:  # block diffusion's one pass over [x_t ; x_0]: both halves at positions 0..L-1
            input_ids = torch.cat([input_ids, clean_ids.to(input_ids.device)], dim=1)  # [B, L] + [B, L] -> [B, 2L]
            cos, sin = cos.repeat(2, 1), sin.repeat(2, 1)  # [L, head_dim / 2] -> [2L, head_dim / 2]
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, cond, cos, sin, mask)
        x = self.final_norm(x[:, :length])  # the noisy half (every row without a clean copy)
        if self.final_modulation is not None:
            shift, scale = self.final_modulation(cond)[:, None].chunk(2, dim=-1)
            x = modulate(x, shift, scale)
        logits = self._logits(x)
        if return_dict is False:
            return (logits,)
        return MaskedLMOutput(logits=logits)

    def _block_mask(self, input_ids: Tensor, clean_ids: Tensor | None) -> Tensor | None:
        """The attention mask of a block model's call (None for any other model), its misuse refused."""
        block_size = self.config.block_size
        if block_size is None:
            if clean_ids is not None:
                raise ValueError("clean_ids is for block diffusion models (config.block_size set); this model is "
                                 "called with input_ids (and t) only")
            return None
        if clean_ids is None:
            raise ValueError(f"this is a block diffusion model (block_size {block_size}): pass clean_ids, the clean "
                             "sequence x_0 [B, L] (each block of input_ids is predicted given clean_ids' blocks "
                             "before it)")
        if clean_ids.shape != input_ids.shape:
            raise ValueError(f"clean_ids must have input_ids' shape {tuple(input_ids.shape)}, got "
                             f"{tuple(clean_ids.shape)}")
        if input_ids.shape[1] % block_size:
            raise ValueError(f"sequence length {input_ids.shape[1]} is not a multiple of block_size {block_size}: "
                             "pad or cut it to whole blocks")
        return block_diffusion_mask(input_ids.shape[1], block_size, input_ids.device)

    def _logits(self, hidden: Tensor) -> Tensor:
        v = self.net["vocab_size"]
        if self.head is None:
            return F.linear(hidden, self.embed.weight[:v])
        bias = None if self.head.bias is None else self.head.bias[:v]
        return F.linear(hidden, self.head.weight[:v], bias)  # the mask's row, if any, is never used
