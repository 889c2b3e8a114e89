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

A model adapted from an autoregressive one (unmask's docs/adapting.md) is called the same way:
its pretrained family's layers (``network["family"]``: GPT-2's or Llama's) and its shift (each
token predicted at the row before it, from a start row, ``network["shift"]``) are inside.
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
    "document_separator", "shift", "family",
)
# A pretrained family's layer choices (``network["family"]``), at unmask's own network's values.
FAMILY_DEFAULTS = {"learned_positions": 0, "norm": "layernorm", "norm_bias": False, "mlp": "gelu", "mlp_hidden": 0,
                   "kv_heads": 0, "qkv_bias": False, "out_bias": False}
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
        unknown = sorted(set(self.network.get("family") or {}) - set(FAMILY_DEFAULTS))
        if unknown:
            raise ValueError(f"this modeling file does not know the network family fields {unknown}: export again "
                             "with the unmask version that trained the model")
        if self.network.get("vocab_multiple", 1) != 1:  # exports drop the padded vocabulary rows
            raise ValueError(f"network vocab_multiple = {self.network['vocab_multiple']}: this file takes the "
                             "weights of an export, whose vocabulary is unpadded (vocab_multiple 1)")
        if self.network.get("document_separator") is not None:  # unmask's model.documents is not carried over
            raise ValueError(f"network document_separator = {self.network['document_separator']}: this file "
                             "attends over the whole window, not per document; use the unmask export")
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


def shifted_rows(input_ids: Tensor, clean_ids: Tensor | None, block_size: int | None, start_id: int
                 ) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """A shifted network's rows: ids [B, rows], positions [rows], mask (bool [rows, rows] or None:
    full) and the rows whose outputs predict x_0..x_{L-1}. MDLM: [start, z] at 0..L. Block
    diffusion: per block b the group [x_{bL'-1}, z^b] (start first) at bL'..(b+1)L', then the
    clean rows [start, x_0..x_{L-2}] at 0..L-1; a group sees itself and the clean rows of the
    blocks before it, a clean row those of its block and before."""
    batch, length = input_ids.shape
    device = input_ids.device
    start = input_ids.new_full((batch, 1), start_id)
    if block_size is None:
        rows = torch.cat([start, input_ids], dim=1)  # [B, L + 1]
        return rows, torch.arange(length + 1, device=device), None, torch.arange(length, device=device)
    blocks, group = length // block_size, block_size + 1
    clean = torch.cat([start, clean_ids[:, :-1].to(device)], dim=1)                       # [B, L]
    groups = torch.cat([clean[:, ::block_size, None], input_ids.view(batch, blocks, block_size)], dim=2)
    ids = torch.cat([groups.flatten(1), clean], dim=1)                                    # [B, blocks (L' + 1) + L]
    offsets = torch.arange(blocks, device=device)[:, None]
    positions = torch.cat([(offsets * block_size + torch.arange(group, device=device)).flatten(),
                           torch.arange(length, device=device)])
    outputs = (offsets * group + torch.arange(block_size, device=device)).flatten()
    row = torch.arange(ids.shape[1], device=device)
    noisy = row < blocks * group
    block = torch.where(noisy, row // group, (row - blocks * group) // block_size)
    q_noisy, k_noisy, q_block, k_block = noisy[:, None], noisy[None, :], block[:, None], block[None, :]
    mask = ((q_noisy & k_noisy & (k_block == q_block)) | (q_noisy & ~k_noisy & (k_block < q_block))
            | (~q_noisy & ~k_noisy & (k_block <= q_block)))
    return ids, positions, mask, outputs


def family_of(net: dict) -> dict:
    """The network's family layer choices, unmask's own where it names none."""
    return {**FAMILY_DEFAULTS, **(net.get("family") or {})}


class LayerNorm(nn.Module):
    """A weight (and with ``bias``, a bias: GPT-2's), in float32."""

    def __init__(self, dim: int, eps: float, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), bias, self.eps).type_as(x)


class RMSNorm(nn.Module):
    """A weight, in float32 (Llama's)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


def norm(net: dict) -> nn.Module:
    family = family_of(net)
    if family["norm"] == "rmsnorm":
        return RMSNorm(net["d_model"], net["norm_eps"])
    return LayerNorm(net["d_model"], net["norm_eps"], family["norm_bias"])


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
        family = family_of(net)
        self.n_heads, self.causal = net["n_heads"], net["causal"]
        self.kv_heads, head_dim = family["kv_heads"] or net["n_heads"], net["d_model"] // net["n_heads"]
        self.qkv = nn.Linear(net["d_model"], (self.n_heads + 2 * self.kv_heads) * head_dim, bias=family["qkv_bias"])
        self.out = nn.Linear(net["d_model"], net["d_model"], bias=family["out_bias"])

    def forward(self, x: Tensor, cos: Tensor | None, sin: Tensor | None, mask: Tensor | None = None) -> Tensor:
        """x [B, rows, d]; ``mask`` (bool [rows, rows]) replaces the network's own full or causal
        attention; ``cos`` None: positions are a learned table's, added to the input."""
        batch, length, width = x.shape
        head_dim = width // self.n_heads
        q, k, v = self.qkv(x).split([width, self.kv_heads * head_dim, self.kv_heads * head_dim], dim=-1)
        # [B, rows, heads * head_dim] -> [B, heads, rows, head_dim] (k and v: kv_heads)
        q, k, v = (y.view(batch, length, -1, head_dim).transpose(1, 2) for y in (q, k, v))
        if cos is not None:
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if self.kv_heads != self.n_heads:  # grouped-query attention: each k, v head serves heads / kv_heads
            k, v = (y.repeat_interleave(self.n_heads // self.kv_heads, dim=1) for y in (k, v))
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(batch, length, width))


class MLP(nn.Module):
    def __init__(self, net: dict) -> None:
        super().__init__()
        family = family_of(net)
        hidden = family["mlp_hidden"] or net["mlp_ratio"] * net["d_model"]
        swiglu = family["mlp"] == "swiglu"
        self.gate = nn.Linear(net["d_model"], hidden, bias=net["mlp_bias"]) if swiglu else None
        self.up = nn.Linear(net["d_model"], hidden, bias=net["mlp_bias"])
        self.down = nn.Linear(hidden, net["d_model"], bias=net["mlp_bias"])

    def forward(self, x: Tensor) -> Tensor:
        if self.gate is not None:  # SwiGLU (Llama's)
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x), approximate="tanh"))


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale) + shift


def modulated(net: dict) -> bool:
    return net["time_conditioning"] or net["adaptive_norm"]


class Block(nn.Module):
    def __init__(self, net: dict) -> None:
        super().__init__()
        self.attn_norm = norm(net)
        self.attn = SelfAttention(net)
        self.mlp_norm = norm(net)
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
        elif isinstance(module, (LayerNorm, RMSNorm)):
            nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


class UnmaskForMaskedLM(UnmaskPreTrainedModel):
    """The denoiser: ``(input_ids [B, L], t [B]) -> logits [B, L, V]``, a block model's with
    ``clean_ids`` [B, L] too; see the module docstring."""

    def __init__(self, config: UnmaskConfig) -> None:
        super().__init__(config)
        net = self.net = config.network
        d, v = net["d_model"], net["vocab_size"]
        self.embed = nn.Embedding(v + 1 + int(net.get("shift", False)), d)  # the tokens, the mask (and the start)
        learned = family_of(net)["learned_positions"]
        self.positions = nn.Embedding(learned, d) if learned else None  # GPT-2's table; None: rotary
        self.time_embed = TimeEmbedding(net) if modulated(net) else None
        self.blocks = nn.ModuleList(Block(net) for _ in range(net["n_layers"]))
        self.final_norm = norm(net)
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
        ids, positions, mask, outputs = self._rows(input_ids, clean_ids, mask)
        x = self.embed(ids)
        cos = sin = None
        if self.positions is not None:
            x = x + self.positions(positions)
        else:
            cos, sin = rotary_tables(int(positions.max()) + 1, net["d_model"] // net["n_heads"], net["rope_base"],
                                     net["rope_angles"], input_ids.device)
            cos, sin = cos[positions], sin[positions]  # [rows, head_dim / 2]
        for block in self.blocks:
            x = block(x, cond, cos, sin, mask)
        x = self.final_norm(x.index_select(1, outputs))  # the rows that predict x_0..x_{L-1}
        if self.final_modulation is not None:
            shift, scale = self.final_modulation(cond)[:, None].chunk(2, dim=-1)
            x = modulate(x, shift, scale)
        logits = self._logits(x)
        if return_dict is False:
            return (logits,)
        return MaskedLMOutput(logits=logits)

    def _rows(self, input_ids: Tensor, clean_ids: Tensor | None, mask: Tensor | None
              ) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
        """The ids, positions, mask and output rows of a call: [x_t] (block diffusion: [x_t ; x_0],
        both halves at positions 0..L-1), or a shifted network's (``shifted_rows``)."""
        length, device = input_ids.shape[1], input_ids.device
        if self.net.get("shift", False):
            return shifted_rows(input_ids, clean_ids, self.config.block_size, self.net["vocab_size"] + 1)
        positions = torch.arange(length, device=device)
        if mask is None:
            return input_ids, positions, None, positions
        ids = torch.cat([input_ids, clean_ids.to(device)], dim=1)  # [B, L] + [B, L] -> [B, 2L]
        return ids, positions.repeat(2), mask, positions  # the noisy half answers

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
