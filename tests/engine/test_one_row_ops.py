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
            want: list[int] = []
            with torch.no_grad():
                for _ in range(len(got)):
                    logits = hf(torch.tensor([ids + want])).logits[0, -1]
                    want.append(int(torch.argmax(logits)))
            assert got == want, prompt
    finally:
        cpu_ext.decode_attention = real  # type: ignore[assignment]
    assert calls["n"] > 0  # the fused attention ran
    set_one_row_ops(model, False)
    assert _flags(model) == {False}
    pool_whole(llm)  # the fused KV writes go to the slots the scheduler gave: nothing leaked
