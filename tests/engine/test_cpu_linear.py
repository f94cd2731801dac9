"""The oneDNN-packed fp32 and bf16 linear layers a CPU model loads with (engine/models/cpu_linear.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from prefixgate.engine.models import cpu_linear
from prefixgate.engine.models.cpu_linear import (
    ONE_ROW_KINDS,
    OneDNNLinear,
    available_memory_bytes,
    calibrate_one_row,
    one_row_extra_bytes,
    onednn_bf16_available,
    onednn_linear_available,
    pack_linears,
    use_onednn_linear,
)
from prefixgate.engine.models.quantization import Int8Linear
from prefixgate.kernels import cpu_ext
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: make model_helpers importable
from model_helpers import load  # noqa: E402

pytestmark = pytest.mark.skipif(
    not onednn_linear_available(), reason="torch built without oneDNN's prepacked linear"
)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [0, 1, 3, 32, 200])
def test_matches_nn_linear(bias, rows):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias)
    packed = OneDNNLinear.from_linear(linear)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        got, want = packed(x), linear(x)
    assert got.shape == (rows, 160) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_leading_dims_non_contiguous_input_and_weight_copy():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    packed = OneDNNLinear.from_linear(linear)
    x = torch.randn(5, 64, 2)[..., 0]  # non-contiguous [5, 64]
    torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 3, 64)
    assert packed(x3).shape == (2, 3, 48)
    assert torch.equal(packed.weight, linear.weight.detach())
    assert packed.weight.data_ptr() != linear.weight.data_ptr()  # packed copy, never shared


def test_refuses_other_dtypes_and_devices():
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU weight"):
        OneDNNLinear(torch.zeros(4, 4, dtype=torch.float16), None)


def test_used_for_fp32_and_native_bf16_cpu_without_quantization():
    assert use_onednn_linear("cpu", torch.float32, None)
    assert use_onednn_linear("cpu", torch.bfloat16, None) == onednn_bf16_available()
    assert not use_onednn_linear("cpu", torch.float16, None)
    assert not use_onednn_linear("cpu", torch.float32, "int8")
    assert not use_onednn_linear("cuda", torch.float32, None)


@pytest.mark.skipif(not onednn_bf16_available(), reason="no native oneDNN bf16 on this CPU")
@pytest.mark.parametrize("rows", [1, 3, 32, 40])
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_matches_torch_linear(rows, bias):
    """bf16 through oneDNN's packed weight against torch's bf16 linear: both accumulate in
    fp32 and round once to bf16, so they differ by a bf16 rounding step at most; a bf16 layer
    keeps oneDNN at one row."""
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(70, 130, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 70, generator=gen).to(torch.bfloat16)
    packed = OneDNNLinear.from_linear(linear)
    assert packed.dtype == torch.bfloat16 and packed.shares_table and not packed.shares_gemv
    assert torch.equal(packed.weight, linear.weight.detach())
    with torch.no_grad():
        want = linear(x).float()
    got = packed(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="keeps oneDNN"):
        packed.set_one_row("gemv")


def test_loader_packs_every_linear_and_int8_still_quantizes(aidreams_path):
    model = load(aidreams_path)
    assert not [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    num_packed = sum(isinstance(m, OneDNNLinear) for m in model.modules())
    assert num_packed == 4 * model.config.num_layers + 1  # qkv, o, gate_up, down + head
    # the tied head is a packed copy of the embedding, which stays a plain tensor
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    quant = load(aidreams_path, quantization="int8")
    assert isinstance(quant.lm_head, Int8Linear)
    assert not any(isinstance(m, OneDNNLinear) for m in quant.modules())


@pytest.mark.parametrize("kind", ONE_ROW_KINDS)
@pytest.mark.parametrize("bias", [True, False])
def test_one_row_gemms_match_nn_linear(kind, bias):
    if kind == "gemv" and not cpu_ext.available():
        pytest.skip("prefixgate CPU ops not built here (no AVX2 or no compiler)")
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias)
    packed = OneDNNLinear.from_linear(linear)
    packed.set_one_row(kind)
    assert packed.one_row == kind
    # "gemv" reads oneDNN's packed weight itself where its layout is panels (no copy)
    copy = kind in ("linear", "mm_t") or (kind == "gemv" and not packed.shares_gemv)
    assert packed.one_row_bytes == (96 * 160 * 4 if copy else 0)  # 160 = 20 * 8
    with torch.inference_mode():
        for x in (torch.randn(1, 96), torch.randn(1, 1, 96), torch.randn(3, 96)):
            got, want = packed(x), linear(x)
            assert got.shape == want.shape and got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # a non-contiguous one-row input
        x = torch.randn(1, 96, 2)[..., 0]
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    packed.set_one_row("onednn")
    assert packed.one_row_bytes == 0


def test_one_row_refuses_unknown_kind():
    packed = OneDNNLinear.from_linear(nn.Linear(8, 8))
    with pytest.raises(ValueError, match="unknown one-row GEMM 'gemm1'"):
        packed.set_one_row("gemm1")


def test_calibrate_one_row_sets_every_layer_of_a_shape():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 256, bias=False))
    ref = [m.weight.detach().clone() for m in model]
    pack_linears(model)
    chosen = calibrate_one_row(model, rounds=1, reps=1, min_bytes=0)
    assert set(chosen) == {(64, 64), (256, 64)}
    assert set(chosen.values()) <= set(ONE_ROW_KINDS)
    layers = list(model)
    assert layers[0].one_row == layers[1].one_row == chosen[(64, 64)]
    assert layers[2].one_row == chosen[(256, 64)]
    assert one_row_extra_bytes(model) == sum(m.one_row_bytes for m in layers)
    x = torch.randn(1, 64)
    with torch.inference_mode():
        want = x
        for w, m in zip(ref, model, strict=True):
            want = F.linear(want, w, m.bias)
        torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)


def test_loader_calibrates_one_row_gemms(aidreams_path):
    model = load(aidreams_path)
    packed = [m for m in model.modules() if isinstance(m, OneDNNLinear)]
    # a model this small stays in the caches: oneDNN everywhere, untimed (the same each load)
    assert all(m.one_row == "onednn" for m in packed)
    calibrate_one_row(model, rounds=1, reps=1, min_bytes=0)  # timed: a kind per shape
    assert all(m.one_row in ONE_ROW_KINDS for m in packed)
    by_shape = {}
    for m in packed:  # one choice per shape
        by_shape.setdefault((m.out_features, m.in_features), set()).add(m.one_row)
    assert all(len(kinds) == 1 for kinds in by_shape.values())


def test_calibrate_one_row_keeps_onednn_past_the_memory_budget():
    model = pack_linears(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 256)))
    chosen = calibrate_one_row(model, rounds=1, reps=1, memory_budget=0, min_bytes=0, copies=True)
    # only kinds that keep no copy fit a budget of 0: oneDNN, or gemv on its packed weight
    assert all(
        k == "onednn" or (k == "gemv" and m.shares_gemv)
        for k, m in zip(chosen.values(), model, strict=True)
    )
    assert one_row_extra_bytes(model) == 0
    assert available_memory_bytes() is None or available_memory_bytes() > 0


def _fake_times(gemv_s: float, others_s: float):
    """A ``_time_one_row`` stand-in: ``gemv_s`` for the gemv kind's functions, ``others_s`` for
    every other kind's (so the choice is the margin rule's, never the host's noise)."""

    def fake(fns, x, reps):
        return gemv_s if fns[0].func is cpu_linear._gemv_one else others_s

    return fake


@pytest.mark.skipif(not cpu_ext.available(), reason="prefixgate CPU ops not built here")
@pytest.mark.parametrize(
    "gemv_s,want", [(0.5, "gemv"), (0.97, "onednn"), (1.5, "onednn")]
)  # 3 % faster is inside ONE_ROW_MARGIN (5 %): oneDNN stays
def test_calibrate_picks_gemv_only_where_it_is_faster(monkeypatch, gemv_s, want):
    monkeypatch.setattr(cpu_linear, "_time_one_row", _fake_times(gemv_s, 1.0))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 100))
    ref = [m.weight.detach().clone() for m in model]
    pack_linears(model)
    chosen = calibrate_one_row(model, rounds=1, reps=1, min_bytes=0)
    assert set(chosen.values()) == {want}
    assert all(m.one_row == want for m in model)
    x = torch.randn(1, 64)
    with torch.inference_mode():
        want_y = F.linear(F.linear(x, ref[0], model[0].bias), ref[1], model[1].bias)
        torch.testing.assert_close(model(x), want_y, rtol=1e-5, atol=1e-5)


def test_calibrate_never_times_gemv_without_the_ops(monkeypatch):
    monkeypatch.setattr(cpu_ext, "available", lambda: False)
    monkeypatch.setattr(cpu_linear, "_time_one_row", _fake_times(0.1, 1.0))
    model = pack_linears(nn.Sequential(nn.Linear(64, 64)))
    assert cpu_linear.one_row_kinds() == ("onednn", "linear", "mm_t")
    chosen = calibrate_one_row(model, rounds=1, reps=1, min_bytes=0)
    assert set(chosen.values()) == {"onednn"}  # the others all timed alike: no 5 % win
    with pytest.raises(RuntimeError, match="needs prefixgate's CPU ops"):
        model[0].set_one_row("gemv")
