"""Batch-1 decode through prefixgate's fused CPU ops (layers.set_one_row_ops, cpu_ext) on the
real tiny model: greedy output still equals transformers', and the loader keeps the ops off for
models under ``CALIBRATION_MIN_BYTES`` (every test model), so other tests' numerics are torch's.

Skipped where the ops cannot be built (the first test here may build them: ~20 s once).
"""

from __future__ import annotations

import pytest
import torch
from prefixgate.engine import LLM, SamplingParams
from prefixgate.engine.models.cpu_linear import OneDNNLinear
from prefixgate.engine.models.layers import MLP, Attention, RMSNorm, set_one_row_ops
from prefixgate.kernels import cpu_ext
from support.prompts import DREAM_PROMPTS

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _hf_greedy(hf: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """transformers' ``n`` greedy tokens after ``ids``, the whole sequence run each step."""
    want: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids + want])).logits[0, -1]
            want.append(int(torch.argmax(logits)))
    return want


def _flags(model: torch.nn.Module) -> set[bool]:
    return {m.one_row_ops for m in model.modules() if isinstance(m, RMSNorm | Attention | MLP)}


def test_loader_keeps_torch_ops_for_small_models(aidreams_path):
    llm = LLM(aidreams_path, block_size=16)
    assert _flags(llm.engine.runner.model) == {False}


@pytest.mark.skipif(not cpu_ext.available(), reason="prefixgate CPU ops not built here")
def test_fused_one_row_decode_matches_transformers(aidreams_path, pool_whole):
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(aidreams_path, torch_dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(aidreams_path)
    llm = LLM(aidreams_path, block_size=16)
    model = llm.engine.runner.model
    # two norms, the attention and the MLP a layer, and the final norm
    assert set_one_row_ops(model, True) == 4 * model.config.num_layers + 1
    for m in model.modules():  # the AVX2 GEMV at one row too
        if isinstance(m, OneDNNLinear):
            m.set_one_row("gemv")
    calls = {"n": 0}
    real = cpu_ext.decode_attention

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    cpu_ext.decode_attention = counting  # type: ignore[assignment]
    try:
        for prompt in DREAM_PROMPTS[:6]:  # one request at a time: every decode step is batch 1
            ids = tok(prompt).input_ids
            out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24))
            got = out[0].outputs[0].token_ids
            assert got == _hf_greedy(hf, ids, len(got)), prompt
    finally:
        cpu_ext.decode_attention = real  # type: ignore[assignment]
    assert calls["n"] > 0  # the fused attention ran
    set_one_row_ops(model, False)
    assert _flags(model) == {False}
    pool_whole(llm)  # the fused KV writes go to the slots the scheduler gave: nothing leaked


def _counted(fn, calls: dict[str, int]):
    """``fn`` with each call counted in ``calls["n"]``."""

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        return fn(*args, **kwargs)

    return wrapped


def _generate(llm: LLM, prompts: list[str]) -> list[tuple[list[int], list]]:
    sp = SamplingParams(temperature=0.0, max_tokens=16, logprobs=3)
    outs = []
    for prompt in prompts:  # one at a time: every decode step is one token alone
        o = llm.generate([prompt], sp)[0].outputs[0]
        outs.append((list(o.token_ids), o.logprobs))
    return outs


@pytest.mark.skipif(not cpu_ext.available(), reason="prefixgate CPU ops not built here")
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_one_call_a_layer_equals_the_fused_ops_bit_for_bit(
    aidreams_path, pool_whole, monkeypatch, quantization
):
    """decode_layer runs the fused ops in DecoderLayer.forward's order: the same tokens and the
    same logprobs (floats equal) as the per-op path, for every one-row GEMM kind it takes;
    changing a kind after the first step is seen (the cached specs are rebuilt: the per-op
    path with the new kind still equals it), and a layer with a linear it cannot take
    (FBGEMM's packed weight) keeps its modules."""
    from prefixgate.engine.models.layers import DecoderLayer, set_one_row_layers
    from prefixgate.engine.models.quantization import INT8_ONE_ROW_KINDS, Int8Linear

    llm = LLM(aidreams_path, block_size=16, quantization=quantization)
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    assert {m.one_row_layer for m in layers} == {False}  # under the size gate: off
    if quantization is None:
        linears = [m for m in model.modules() if isinstance(m, OneDNNLinear)]
        kinds = ["gemv", "mm_t", "linear", "onednn"]
    else:
        linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
        kinds = [k for k in INT8_ONE_ROW_KINDS if k != "fbgemm"]
    for i, m in enumerate(linears):  # every kind the layer op takes, mixed within layers
        m.set_one_row(kinds[i % len(kinds)])
    set_one_row_ops(model, True)
    prompts = DREAM_PROMPTS[:4]
    per_op = _generate(llm, prompts)
    calls = {"n": 0}
    real = cpu_ext.decode_layer
    monkeypatch.setattr(cpu_ext, "decode_layer", _counted(real, calls))
    assert set_one_row_layers(model, True) == len(layers)
    assert _generate(llm, prompts) == per_op
    every_layer = calls["n"]
    assert every_layer > 0 and every_layer % len(layers) == 0
    down = layers[0].mlp.down_proj
    if quantization is None:  # another kind: every layer still takes decode_layer
        down.set_one_row("mm_t" if down.one_row != "mm_t" else "gemv")
        taking = len(layers)
    else:  # FBGEMM: layer 0 can no longer take it
        down.set_one_row("fbgemm")
        taking = len(layers) - 1
    calls["n"] = 0
    mixed = _generate(llm, prompts)
    assert calls["n"] == every_layer // len(layers) * taking
    set_one_row_layers(model, False)
    assert _generate(llm, prompts) == mixed  # the per-op path with layer 0's new kind
    pool_whole(llm)


def _rows_of_calls(monkeypatch, name: str) -> list[int]:
    """Wrap ``cpu_ext.<name>`` (an op whose first argument is ``[rows, ...]``) to record each
    call's rows in the list returned."""
    rows: list[int] = []
    real = getattr(cpu_ext, name)

    def counting(x, *args):
        rows.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(cpu_ext, name, counting)
    return rows


@pytest.mark.skipif(not cpu_ext.available(), reason="prefixgate CPU ops not built here")
def test_batched_decode_ops_match_transformers(aidreams_path, pool_whole, monkeypatch):
    """set_decode_ops: prompts generated together (decode steps of many rows, prefill norms,
    activations and attention of many rows) through the batched C++ ops give transformers'
    greedy tokens, and the batched decode attention ran on steps of several rows."""
    from prefixgate.engine.models.layers import set_decode_ops

    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(aidreams_path, torch_dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(aidreams_path)
    llm = LLM(aidreams_path, block_size=16)
    model = llm.engine.runner.model
    assert {m.decode_ops for m in model.modules() if isinstance(m, RMSNorm)} == {False}
    assert set_decode_ops(model, True) == 4 * model.config.num_layers + 1
    rows = _rows_of_calls(monkeypatch, "decode_attention")
    prefill_rows = _rows_of_calls(monkeypatch, "prefill_attention")
    prompts = DREAM_PROMPTS[:8]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20))
    assert max(rows) == len(prompts)  # every prompt's decode in one call
    cfg = model.config
    if cpu_ext.prefill_attention_supported(cfg.head_dim, cfg.num_heads // cfg.num_kv_heads):
        assert sum(prefill_rows) >= len(prompts) * cfg.num_layers  # the prompts' prefill
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tok(prompt).input_ids
        got = list(out.outputs[0].token_ids)
        assert got == _hf_greedy(hf, ids, len(got)), prompt
    set_decode_ops(model, False)
    pool_whole(llm)
