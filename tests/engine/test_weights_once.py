"""Weights held once on CPU: the one-row GEMV and the tied embedding read oneDNN's packed
weights (engine/models/cpu_linear.py), so a loaded model holds one copy of each matrix.

Bytes are counted from the tensors' storages (``cpu_linear.weight_storage_bytes``), never
from the process's RSS.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from prefixgate.engine.models import cpu_linear
from prefixgate.engine.models.cpu_linear import (
    OneDNNLinear,
    PanelEmbedding,
    calibrate_one_row,
    one_row_extra_bytes,
    onednn_bf16_available,
    onednn_linear_available,
    onednn_storage_bytes,
    weight_storage_bytes,
)
from prefixgate.kernels import cpu_ext
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: make model_helpers importable
from model_helpers import PagedRunner, load  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not onednn_linear_available(), reason="torch without oneDNN's linear"),
    pytest.mark.skipif(not cpu_ext.available(), reason="prefixgate CPU ops not built here"),
    pytest.mark.usefixtures("one_thread"),
]


def _gemv_wins(fns, x, reps):
    """A ``_time_one_row`` stand-in under which "gemv" always wins (what the calibration picks
    where it is faster, as on the dev machine), so the choice never depends on the host."""
    return 0.1 if fns[0].func is cpu_linear._gemv_one else 1.0


def _skip_unless_panels(model: nn.Module) -> None:
    if not all(m.shares_gemv for m in model.modules() if isinstance(m, OneDNNLinear)):
        pytest.skip("oneDNN's packed layout on this CPU is not panels: gemv keeps a copy")


def _one_copy_bytes(model: nn.Module) -> int:
    """One copy of the model's weights as packed: each linear's oneDNN buffer (its padding
    included) plus every parameter that is no linear's (norms; an untied embedding)."""
    packed = [m for m in model.modules() if isinstance(m, OneDNNLinear)]
    rest = sum(p.numel() * p.element_size() for p in model.parameters())
    return sum(onednn_storage_bytes(m._packed) for m in packed) + rest


def _greedy_logits(model: nn.Module, steps: int = 12) -> torch.Tensor:
    """``[1 + steps, V]`` logits of a fixed 7-token prompt's prefill, then of ``steps``
    one-row decode steps, each fed the greedy token of the row before (``PagedRunner``)."""
    runner = PagedRunner(model)
    logits = [runner.step([("a", [1, 400, 20, 87, 3, 55, 9])])]
    for _ in range(steps):
        tok = int(logits[-1][0].argmax())
        logits.append(runner.step([("a", [tok])]))
    return torch.cat(logits)


def test_tied_model_holds_each_matrix_once(aidreams_path, monkeypatch):
    model = load(aidreams_path, load_format="dummy")
    _skip_unless_panels(model)
    assert isinstance(model.model.embed_tokens, PanelEmbedding)  # the table is the head's
    assert not any(isinstance(m, (nn.Linear, nn.Embedding)) for m in model.modules())
    monkeypatch.setattr(cpu_linear, "_time_one_row", _gemv_wins)
    chosen = calibrate_one_row(model, rounds=1, reps=1, min_bytes=0)
    assert set(chosen.values()) == {"gemv"}
    assert one_row_extra_bytes(model) == 0
    held = weight_storage_bytes(model)
    assert held == _one_copy_bytes(model)
    # oneDNN's padding (rows to the panel width, columns to 16) is all that exceeds the
    # checkpoint's fp32 bytes (the tied matrix counted once)
    cfg = model.config
    dense = sum(
        m.out_features * m.in_features * 4 for m in model.modules() if isinstance(m, OneDNNLinear)
    ) + sum(p.numel() * 4 for p in model.parameters())
    padding = held - dense
    assert 0 <= padding < 0.15 * dense, (held, dense)
    assert cfg.tie_word_embeddings


def test_copies_are_opt_in(aidreams_path, monkeypatch):
    """``copies=True`` lets the kinds that keep a second copy compete (the old calibration);
    their bytes show in the count."""
    model = load(aidreams_path, load_format="dummy")
    _skip_unless_panels(model)
    one = weight_storage_bytes(model)
    for m in model.modules():
        if isinstance(m, OneDNNLinear):
            m.set_one_row("mm_t")
    assert weight_storage_bytes(model) == one + one_row_extra_bytes(model) > one
    for m in model.modules():
        if isinstance(m, OneDNNLinear):
            m.set_one_row("gemv")
    assert weight_storage_bytes(model) == one and one_row_extra_bytes(model) == 0


def test_panel_embedding_is_the_tied_table_bit_for_bit(aidreams_path):
    plain = load(aidreams_path)  # real weights
    table = plain.model.embed_tokens.weight
    assert torch.equal(table, plain.lm_head.weight)
    if not isinstance(plain.model.embed_tokens, PanelEmbedding):
        pytest.skip("oneDNN's packed layout on this CPU is not panels")
    ids = torch.tensor([[0, 1, 511, 64, 63], [5, 5, 200, 128, 2]])
    got = plain.model.embed_tokens(ids)
    assert got.shape == (2, 5, 64)
    assert torch.equal(got, table[ids])
    assert plain.model.embed_tokens(torch.zeros(0, dtype=torch.long)).shape == (0, 64)
    for bad in (-1, 512):
        with pytest.raises(IndexError, match="out of range"):
            plain.model.embed_tokens(torch.tensor([3, bad]))


def test_gemv_on_packed_weights_keeps_the_logits(aidreams_path, monkeypatch):
    """The shared-weight GEMV at one row against oneDNN's: the same model's decode logits
    within fp32 rounding (another summation order), greedy tokens equal."""
    base = load(aidreams_path)
    _skip_unless_panels(base)
    fast = load(aidreams_path)
    monkeypatch.setattr(cpu_linear, "_time_one_row", _gemv_wins)
    calibrate_one_row(fast, rounds=1, reps=1, min_bytes=0)
    runs = [_greedy_logits(model) for model in (base, fast)]
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(runs[1].argmax(-1), runs[0].argmax(-1))


@pytest.mark.slow
def test_smollm2_shape_holds_exactly_one_copy(smollm2_shape_path):
    """The SmolLM2-135M shape (dummy weights): every dimension a multiple of oneDNN's blocks,
    so the model holds exactly its checkpoint's fp32 bytes, whatever the calibration chose."""
    model = load(smollm2_shape_path, load_format="dummy")
    _skip_unless_panels(model)
    assert one_row_extra_bytes(model) == 0
    dense = sum(
        m.out_features * m.in_features * 4 for m in model.modules() if isinstance(m, OneDNNLinear)
    ) + sum(p.numel() * 4 for p in model.parameters())
    assert weight_storage_bytes(model) == dense


@pytest.mark.skipif(not onednn_bf16_available(), reason="no native oneDNN bf16 on this CPU")
def test_bf16_model_holds_each_matrix_once_and_keeps_torchs_tokens(aidreams_path, monkeypatch):
    """bf16 packs as fp32 does: every linear oneDNN's, the tied table read from the head's
    column-pair panels bit for bit, one copy of each matrix; greedy tokens equal those of
    torch's bf16 linears (both accumulate in fp32), the logits within bf16 rounding."""
    model = load(aidreams_path, dtype="bfloat16")
    embed = model.model.embed_tokens
    assert isinstance(embed, PanelEmbedding)
    assert not any(isinstance(m, (nn.Linear, nn.Embedding)) for m in model.modules())
    assert weight_storage_bytes(model) == _one_copy_bytes(model)
    table = model.lm_head.weight
    assert table.dtype == torch.bfloat16 and torch.equal(embed.weight, table)
    ids = torch.tensor([[0, 1, 511, 64, 63], [5, 5, 200, 128, 2]])
    assert torch.equal(embed(ids), table[ids])
    monkeypatch.setattr(cpu_linear, "use_onednn_linear", lambda *a: False)
    import prefixgate.engine.models.loader as loader

    monkeypatch.setattr(loader, "use_onednn_linear", lambda *a: False)
    plain = load(aidreams_path, dtype="bfloat16")
    assert isinstance(plain.lm_head, nn.Linear)
    runs = [_greedy_logits(m).float() for m in (plain, model)]
    assert torch.equal(runs[1].argmax(-1), runs[0].argmax(-1))
    torch.testing.assert_close(runs[1], runs[0], rtol=0.05, atol=0.05)
