"""A bf16 model's batched steps through prefixgate's C++ CPU ops (layers.set_decode_ops on bf16
rows and a bf16 KV cache) on the real tiny model: greedy tokens equal the torch bf16 path's, the
batched decode attention ran on steps of several rows, and the ops hold no copy of a weight.

How the tokens are compared: both runs are bf16 end to end (the same oneDNN linears, the same
bf16 roundings of every op's output); only the attention's internals differ (the ops keep scores
and probabilities in fp32 where SDPA rounds its bf16 inputs' products its own way), so a token may
differ only where the reference's top two logits tie within bf16 rounding. On aidreams none does:
the test asserts equality of every token.

Skipped where the ops cannot be built.
"""

from __future__ import annotations

import pytest
import torch
from prefixgate.engine import LLM, SamplingParams
from prefixgate.engine.models.layers import MLP, Attention, RMSNorm, set_decode_ops
from prefixgate.kernels import cpu_ext
from support.prompts import DREAM_PROMPTS

pytestmark = [
    pytest.mark.usefixtures("one_thread"),  # tests/conftest.py
    pytest.mark.skipif(not cpu_ext.available(), reason="prefixgate CPU ops not built here"),
]


def test_bf16_batched_ops_keep_the_torch_bf16_tokens(aidreams_path, pool_whole, monkeypatch):
    llm = LLM(aidreams_path, block_size=16, dtype="bfloat16")
    model = llm.engine.runner.model
    assert next(model.parameters()).dtype == torch.bfloat16
    # the loader keeps torch's ops for test-sized models
    assert {m.decode_ops for m in model.modules() if isinstance(m, RMSNorm)} == {False}
    params = {name: (p.data_ptr(), p.dtype) for name, p in model.named_parameters()}
    prompts = DREAM_PROMPTS[:8]
    params_ = SamplingParams(temperature=0.0, max_tokens=20)
    want = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params_)]

    assert set_decode_ops(model, True) == 4 * model.config.num_layers + 1
    calls: dict[str, list[torch.dtype]] = {
        "attention": [],
        "norm": [],
        "silu": [],
        "rotary": [],
        "prefill": [],
    }
    rows: list[int] = []
    real = {
        "attention": cpu_ext.decode_attention,
        "norm": cpu_ext.add_rms_norm,
        "silu": cpu_ext.silu_mul,
        "rotary": cpu_ext.rotary_cache,
        "prefill": cpu_ext.prefill_attention,
    }
    names = {
        "attention": "decode_attention",
        "norm": "add_rms_norm",
        "silu": "silu_mul",
        "rotary": "rotary_cache",
        "prefill": "prefill_attention",
    }
    for key, fn in real.items():

        def counting(x, *args, _key=key, _fn=fn):
            calls[_key].append(x.dtype)
            if _key == "attention":
                rows.append(x.shape[0])
            return _fn(x, *args)

        monkeypatch.setattr(cpu_ext, names[key], counting)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params_)]
    assert got == want
    assert max(rows) == len(prompts)  # every prompt's decode in one call
    cfg = model.config
    if not cpu_ext.prefill_attention_supported(cfg.head_dim, cfg.num_heads // cfg.num_kv_heads):
        del calls["prefill"]  # no AVX-512 here: the torch path
    for key, dtypes in calls.items():  # every op ran, on bf16 rows
        assert dtypes and set(dtypes) == {torch.bfloat16}, key
    k_cache, _ = llm.engine.runner.kv_caches[0]
    assert k_cache.dtype == torch.bfloat16
    # no copy of a weight: the same tensors as before
    assert {name: (p.data_ptr(), p.dtype) for name, p in model.named_parameters()} == params
    assert not any(isinstance(m, Attention | MLP) and m.one_row_ops for m in model.modules())
    set_decode_ops(model, False)
    pool_whole(llm)


@pytest.mark.slow
def test_loader_sets_the_batched_ops_for_a_bf16_model(smollm2_shape_path):
    """Past ``CALIBRATION_MIN_BYTES`` (the SmolLM2-135M shape, dummy weights) a bf16 model gets
    the batched ops (not the fp32-only one-row ops); its KV cache is bf16."""
    llm = LLM(smollm2_shape_path, load_format="dummy", dtype="bfloat16", kv_cache_memory=1 << 26)
    model = llm.engine.runner.model
    kinds = (RMSNorm, Attention, MLP)
    assert {m.decode_ops for m in model.modules() if isinstance(m, kinds)} == {True}
    assert {m.one_row_ops for m in model.modules() if isinstance(m, kinds)} == {False}
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
