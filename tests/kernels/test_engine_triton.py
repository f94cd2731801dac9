"""The engine with ``attention_backend="triton"`` (interpreter on CPU) gives the torch backend's
greedy tokens on the real aidreams-260k model, through chunked prefill, mixed decode + prefill
steps and prefix-cache hits."""

from __future__ import annotations

import pytest
from prefixgate.engine.llm import LLM
from prefixgate.engine.sampling_params import SamplingParams

SHARED_PREFIX = "You dream.\n\nI sense the nodes"  # 20 tokens: one full block of 16 to share
PROMPTS = [SHARED_PREFIX + ", a", "Once"]
FOLLOW_UP = SHARED_PREFIX + " and"  # served after the first batch: hits the prefix cache


def _run(path: str, backend: str) -> tuple[list[list[int]], list[int], int, LLM]:
    llm = LLM(
        path,
        attention_backend=backend,
        device="cpu",
        block_size=16,
        max_num_batched_tokens=16,  # chunked prefill; decodes share steps with prefill chunks
        num_kv_blocks=64,
    )
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = llm.generate(PROMPTS, params)
    second = llm.generate([FOLLOW_UP], params)[0]
    return (
        [o.outputs[0].token_ids for o in first],
        second.outputs[0].token_ids,
        second.num_cached_tokens,
        llm,
    )


@pytest.mark.timeout(600)
def test_triton_backend_greedy_equals_torch(aidreams_path, pool_whole):
    torch_first, torch_second, _, torch_llm = _run(aidreams_path, "torch")
    triton_first, triton_second, cached, triton_llm = _run(aidreams_path, "triton")
    assert triton_first == torch_first
    assert triton_second == torch_second
    assert cached >= 16, "the follow-up prompt should hit the prefix cache"
    assert all(len(t) == 4 for t in triton_first)
    pool_whole(torch_llm)
    pool_whole(triton_llm)
