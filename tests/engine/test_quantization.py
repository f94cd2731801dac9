"""``quantization="int8"``: config checks, the CPU int8 linear, the quantized model on the real
tiny Llama (quality against its fp32 self, batch invariance), and the serve flag."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch
from prefixgate.engine import LLM, SamplingParams
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.models import cpu_linear, quantization
from prefixgate.engine.models.quantization import (
    Int8Linear,
    check_quantization,
    quantize_model,
    quantize_weight,
)
from prefixgate.kernels import cpu_ext
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: make model_helpers importable
from model_helpers import load  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_unknown_method_and_bad_combinations_raise_at_start():
    with pytest.raises(ValueError, match="quantization must be 'int8' or None"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match=r"int8.*CPU.*float32.*bfloat16"):
        LLM(None, quantization="int8", dtype="bfloat16", device="cpu")
    with pytest.raises(ValueError, match="not supported on device"):
        check_quantization("int8", "meta", torch.float32)
    check_quantization(None, "cpu", torch.bfloat16)  # no quantization: anything goes


def test_int8_linear_cpu_close_to_dequantized_and_batch_invariant():
    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(96, 200, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 96, generator=gen) * 0.05)
        lin.bias.copy_(torch.randn(200, generator=gen))
    q = Int8Linear.from_linear(lin)
    x = torch.randn(7, 96, generator=gen)
    x[3] *= 50.0  # an outlier row must not coarsen the other rows' quantization
    out = q(x)
    qw, scale = quantize_weight(lin.weight)
    ref = x @ (qw.float() * scale[:, None]).T + lin.bias
    rel = ((out - ref).abs().amax(1) / ref.abs().amax(1)).max().item()
    assert rel < 0.03, rel
    for i in range(7):  # per-token activation grid: a row alone gives the very same result
        assert torch.equal(q(x[i : i + 1]), out[i : i + 1])
    assert q(x.view(7, 1, 96)).shape == (7, 1, 200)


def test_quantize_model_replaces_every_linear(aidreams_path):
    model = quantize_model(load(aidreams_path), "int8")
    assert not [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert isinstance(model.lm_head, Int8Linear)
    num_int8 = sum(isinstance(m, Int8Linear) for m in model.modules())
    assert num_int8 == 4 * model.config.num_layers + 1  # qkv, o, gate_up, down per layer + head
    assert model.model.embed_tokens.weight.dtype == torch.float32  # embedding kept


def _quality_module():
    import examples.benchmarks.int8_quality as module

    return module


def test_int8_agrees_with_fp32_on_real_text(aidreams_path, workloads_path):
    """Top-1 next-token agreement on a small sample of the workloads' text (the full figure
    comes from ``python -m examples.benchmarks.int8_quality``)."""
    q = _quality_module()
    ref = load(aidreams_path)
    quant = load(aidreams_path, quantization="int8")
    from prefixgate.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(aidreams_path)
    windows = q.windows_of(tok, q.workload_texts(workloads_path), 128, 24)
    result = q.compare(ref, quant, windows)
    assert result["positions"] > 1000
    assert result["top1_agreement"] >= 0.95, result
    assert result["mean_abs_logprob_diff"] < 0.1, result


def test_llm_int8_generates_batch_invariant(aidreams_path, pool_whole):
    llm = LLM(str(aidreams_path), quantization="int8", dtype="float32", device="cpu")
    prompts = ["Once upon a time", "The little dog", "A girl named Lily", "One day"]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert together == alone
    assert all(len(t) > 0 for t in together)
    pool_whole(llm)


def test_serve_flag():
    from prefixgate.gateway.serve.runner import add_serve_parser, engine_config

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--quantization", "int8", "--dtype", "float32"])
    assert engine_config(args).quantization == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--quantization", "int4"])


def _int8_layer(n: int = 100, k: int = 96) -> tuple[Int8Linear, nn.Linear]:
    gen = torch.Generator().manual_seed(n)
    lin = nn.Linear(k, n, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
        lin.bias.copy_(torch.randn(n, generator=gen))
    return Int8Linear.from_linear(lin), lin


@pytest.mark.skipif(not cpu_ext.available(), reason="prefixgate CPU ops not built here")
def test_int8_one_row_gemv_is_the_dequantized_product():
    q, lin = _int8_layer(100, 97)  # N, K off the panel and unroll steps
    q.set_one_row("gemv")
    assert q.one_row_bytes == 104 * 97 + 104 * 4  # padded to 13 panels of 8 rows
    x = torch.randn(1, 97)
    qw, scale = quantize_weight(lin.weight)
    want = x.double() @ (qw.double() * scale.double()[:, None]).T + lin.bias.double()
    with torch.inference_mode():
        torch.testing.assert_close(q(x), want.float(), rtol=1e-5, atol=1e-5)
        many = torch.randn(3, 97)
        q2, _ = _int8_layer(100, 97)
        assert torch.equal(q(many), q2(many))  # more rows: FBGEMM as before
    q.set_one_row("fbgemm")
    assert q.one_row_bytes == 0
    with pytest.raises(ValueError, match="unknown int8 one-row GEMM"):
        q.set_one_row("mm_t")


@pytest.mark.skipif(not cpu_ext.available(), reason="prefixgate CPU ops not built here")
@pytest.mark.parametrize(
    "gemv_s,gemv16_s,want",
    [(0.5, 0.7, "gemv"), (0.7, 0.5, "gemv16"), (0.97, 0.98, "fbgemm"), (2.0, 1.5, "fbgemm")],
)  # the faster GEMV, and only when 5 % faster than FBGEMM (timed 1.0 here)
def test_int8_calibration_picks_a_gemv_only_where_faster(monkeypatch, gemv_s, gemv16_s, want):
    times = {quantization._int8_gemv_one: gemv_s, quantization._int8_gemv16_one: gemv16_s}

    def fake(fns, x, reps):
        return times.get(getattr(fns[0], "func", None), 1.0)

    monkeypatch.setattr(cpu_linear, "_time_one_row", fake)  # fastest_one_row times with it
    model = nn.Sequential(_int8_layer(100, 96)[0], _int8_layer(96, 100)[0])
    chosen = quantization.calibrate_int8_one_row(model, rounds=1, reps=1, min_bytes=0)
    assert set(chosen.values()) == {want}
    assert {m.one_row for m in model} == {want}


@pytest.mark.skipif(not cpu_ext.available(), reason="prefixgate CPU ops not built here")
def test_int8_one_row_gemv16_within_its_activation_rounding():
    q, lin = _int8_layer(100, 97)
    q.set_one_row("gemv16")
    assert q.one_row_bytes == 104 * 98 + 104 * 4  # 13 panels, 49 column pairs
    x = torch.randn(1, 97)
    qw, scale = quantize_weight(lin.weight)
    w = qw.double() * scale.double()[:, None]
    want = x.double() @ w.T + lin.bias.double()
    bound = 0.5 * x.abs().max().double() / 32767 * w.abs().sum(1) + 1e-5
    with torch.inference_mode():
        assert ((q(x).double() - want).abs() <= bound).all()


def test_int8_calibration_keeps_fbgemm_for_small_models(aidreams_path):
    llm = LLM(aidreams_path, quantization="int8")
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Int8Linear)]
    assert layers and {m.one_row for m in layers} == {"fbgemm"}  # under the size gate: untimed
