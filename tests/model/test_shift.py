"""The shift of an adapted autoregressive model (``model.shift``): every token is predicted at
the row before it, from a start row, and each prediction sees exactly what the bound allows.

The oracle test reads the information each output row of the shifted layout can reach (through
every layer) and gives it the exact conditional of that information alone: E[NELBO] = -log p(x)
holds only if a row sees all of its block's z and the clean tokens before it, and nothing more
(MDLM: all of z). A real shifted ``Transformer`` then follows that layout (perturbations) and
predicts the first token too. docs/math.md#the-shift.
"""

from __future__ import annotations

import math

import pytest
import torch

from model.absorbing import AbsorbingDiffusion
from model.block_diffusion import BlockDiffusion
from model.denoiser import Denoiser, FunctionDenoiser
from model.schedules import make_schedule
from model.shift import dense_shifted_mask, shifted_input, shifted_training_layout, shifted_training_rows
from model.transformer import Transformer, TransformerConfig

VOCAB, LENGTH = 3, 4
ORACLE_SIZE = (VOCAB, LENGTH)  # the conftest's `oracle` fixture
MASK, START = VOCAB, VOCAB + 1
Z_LIMIT = 4.0  # |estimate - truth| / standard error; deterministic seeds


def _reach(mask: torch.Tensor) -> torch.Tensor:
    """Which rows each row's output depends on after any number of layers: the transitive
    closure of the attention mask (bool [rows, rows])."""
    reach = mask.clone()
    while True:
        wider = reach | ((reach.double() @ reach.double()) > 0)
        if torch.equal(wider, reach):
            return reach
        reach = wider


def _seen(rows: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The sequences [B, L] that the rows ``visible`` (bool [rows]) reveal: a row at position p
    holds token p - 1 (the start row, p = 0, holds none); the others masked."""
    seen = torch.full((rows.shape[0], LENGTH), MASK)
    for row in visible.nonzero().flatten().tolist():
        index, token = int(positions[row]) - 1, rows[:, row]
        if index >= 0:
            seen[:, index] = torch.where(token != MASK, token, seen[:, index])
    return seen


class ShiftedViewOracle(Denoiser):
    """The exact denoiser, each position's prediction computed from what its row of the shifted
    layout reaches: valid iff the layout shows a row exactly its bound's conditioning."""

    def __init__(self, oracle) -> None:
        self.oracle = oracle

    def logits(self, z_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        rows = shifted_input(z_t, START)                                 # [B, L + 1], full attention
        positions = torch.arange(LENGTH + 1)
        return self.oracle.conditional_logits(_seen(rows, positions, torch.ones(LENGTH + 1, dtype=torch.bool)))

    @property
    def time_independent(self) -> bool:
        return True

    def given_clean(self, x0: torch.Tensor, block_size: int) -> Denoiser:
        layout = shifted_training_layout(LENGTH, block_size, torch.device("cpu"), "dense")
        reach = _reach(layout.mask)[layout.outputs]                      # [L, rows]: what predicts x_i

        def denoiser(z: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
            rows = shifted_training_rows(z, x0, block_size, START)
            out = torch.empty(*z.shape, VOCAB, dtype=torch.float64)
            for i in range(LENGTH):
                out[:, i] = self.oracle.conditional_logits(_seen(rows, layout.positions, reach[i]))[:, i]
            return out
        return FunctionDenoiser(denoiser, time_independent=True)


def _bound_matches(process, denoiser, oracle) -> None:
    order = oracle.probs.argsort(descending=True)
    sequences = oracle.sequences[order[[0, 3, 20, 70]]]
    repeats = 6_000
    batch = sequences.repeat(repeats, 1)
    estimates = process.nelbo(denoiser, batch, generator=torch.Generator().manual_seed(7)).view(repeats, -1)
    mean, standard_error = estimates.mean(0), estimates.std(0) / math.sqrt(repeats)
    truth = -oracle.log_prob(sequences)
    endpoint = 4 * process.schedule.endpoint_eps * LENGTH * math.log(VOCAB)
    assert ((mean - truth).abs() / (standard_error + endpoint)).max() < Z_LIMIT


@pytest.mark.parametrize("block_size", [1, 2, LENGTH])
def test_shifted_block_layout_gives_minus_log_likelihood(oracle, block_size):
    """E[NELBO] = -log p(x) with the exact conditionals of what each shifted row sees."""
    _bound_matches(BlockDiffusion(make_schedule("linear"), VOCAB, block_size), ShiftedViewOracle(oracle), oracle)


def test_shifted_mdlm_gives_minus_log_likelihood(oracle):
    _bound_matches(AbsorbingDiffusion(make_schedule("linear"), VOCAB), ShiftedViewOracle(oracle), oracle)


@pytest.mark.parametrize("block_size", [1, 2, LENGTH])
def test_each_prediction_sees_its_block_and_the_clean_prefix_only(block_size):
    """Row by row: the prediction of x_i (block b) reaches z^b whole and x_{<bL'}; never x_i itself."""
    layout = shifted_training_layout(LENGTH, block_size, torch.device("cpu"), "dense")
    reach = _reach(layout.mask)[layout.outputs]
    z = torch.arange(LENGTH)[None] + 10        # ids that name their kind and position
    x = torch.arange(LENGTH)[None] + 20
    rows = shifted_training_rows(z, x, block_size, START)[0]
    for i in range(LENGTH):
        start = i // block_size * block_size
        seen = {(int(rows[r]), int(layout.positions[r])) for r in reach[i].nonzero().flatten()}
        expected = ({(10 + j, j + 1) for j in range(start, start + block_size)}
                    | {(20 + j, j + 1) for j in range(start)} | {(START, 0)})
        # the group's lead (x_{bL'-1}, or the start) at the block's first position is the clean prefix's last
        assert seen == expected, (i, sorted(seen))


def test_dense_and_flex_rules_agree():
    """The FlexAttention mask_mod is the dense mask's rule (evaluated on the index grid)."""
    from model.shift import shifted_mask_mod

    rows = 4 // 2 * 3 + 4
    q, k = torch.arange(rows)[:, None], torch.arange(rows)[None, :]
    rule = shifted_mask_mod(4, 2)(None, None, q.expand(rows, rows), k.expand(rows, rows))
    assert torch.equal(rule, dense_shifted_mask(4, 2))


# ------------------------------------------------------------------ the network follows the layout
def _shifted_network(**overrides) -> Transformer:
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=11, n_layers=2, d_model=32, n_heads=4, max_seq_len=8, shift=True,
                               **overrides)
    return Transformer(config).double().eval()


def test_shifted_network_predicts_every_position_from_all_of_z():
    network = _shifted_network()
    z = torch.randint(0, 12, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = network(z)
        assert base.shape == (1, 8, 11)
        for j in range(8):
            changed = z.clone()
            changed[0, j] = (z[0, j] + 1) % 12
            moved = (network(changed) - base).abs().amax(-1)[0]
            assert bool((moved > 1e-9).all()), f"changing z_{j} left some prediction unchanged"


def test_shifted_block_forward_sees_what_the_layout_allows():
    """Block diffusion's training forward: block b's predictions move with z^b and x_{<b} only."""
    network, block = _shifted_network(), 2
    generator = torch.Generator().manual_seed(2)
    z = torch.randint(0, 12, (1, 8), generator=generator)
    x = torch.randint(0, 11, (1, 8), generator=generator)
    with torch.no_grad():
        base = network(z, clean=x, block_size=block)
        for j in range(8):
            for name in ("z", "x"):
                z2, x2 = z.clone(), x.clone()
                target = z2 if name == "z" else x2
                target[0, j] = (target[0, j] + 1) % 11
                moved = (network(z2, clean=x2, block_size=block) - base).abs().amax(-1)[0] > 1e-9
                blocks = torch.arange(8) // block
                expected = blocks == j // block if name == "z" else blocks > j // block
                assert torch.equal(moved, expected), (name, j, moved.tolist())
