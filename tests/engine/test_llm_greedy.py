"""End-to-end greedy exactness on the real trained aidreams-260k model.

The reference is Hugging Face ``transformers``' ``LlamaForCausalLM`` (code this project did not
write): greedy continuation by repeated full forward passes (argmax of the last position's
logits, no KV cache), so any paging, batching, chunking or preemption bug shows as a token
mismatch. fp32 throughout; the comparison is exact token equality.
"""

from __future__ import annotations

import random

import pytest
import torch
from prefixgate.engine import LLM, CompletionOutput, SamplingParams
from support.prompts import DREAM_PROMPTS

PROMPTS = DREAM_PROMPTS


def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation with transformers: full forward each step, argmax of last logits."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt_ids) :]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def hf(aidreams_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(aidreams_path, torch_dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(aidreams_path)
    return model.eval(), tok


POLICIES = ["fcfs", "priority", "fair"]


def _tenants(n: int) -> list[str]:
    """Three tenants and mixed priorities, so each scheduling policy orders the work its way."""
    return [f"tenant-{i % 3}" for i in range(n)]


def _priorities(n: int) -> list[int]:
    return [(i * 5) % 4 for i in range(n)]


@pytest.fixture(scope="module", params=POLICIES)
def llm(aidreams_path, request):
    return LLM(aidreams_path, block_size=16, scheduling_policy=request.param)


def _lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 24) for _ in range(n)]


def test_greedy_matches_transformers_all_at_once(llm, hf, pool_whole):
    model, tok = hf
    lens = _lengths(len(PROMPTS))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
    n = len(PROMPTS)
    outs = llm.generate(PROMPTS, params, tenant=_tenants(n), priority=_priorities(n))
    for prompt, n, out in zip(PROMPTS, lens, outs, strict=True):
        ids = tok(prompt).input_ids
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(model, ids, n), prompt
        assert out.outputs[0].finish_reason == "length"
        # the text continues the prompt's text (decoded in context, like vLLM)
        full = tok.decode(ids + out.outputs[0].token_ids, skip_special_tokens=True)
        assert full == tok.decode(ids, skip_special_tokens=True) + out.outputs[0].text
    pool_whole(llm)


def test_greedy_matches_transformers_staggered(llm, hf, pool_whole):
    """Requests join while others are mid-prefill or mid-decode (add_request between steps)."""
    model, tok = hf
    engine = llm.engine
    lens = _lengths(len(PROMPTS), seed=1)
    pending = list(enumerate(PROMPTS))
    final: dict[str, CompletionOutput] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:
            for _ in range(1 + step % 3):
                if pending:
                    i, p = pending.pop(0)
                    engine.add_request(
                        f"s{i}",
                        p,
                        SamplingParams(temperature=0.0, max_tokens=lens[i], ignore_eos=True),
                        tenant=f"tenant-{i % 3}",
                        priority=(i * 5) % 4,
                    )
        for out in engine.step():
            final.setdefault(out.request_id, CompletionOutput()).add(out)
        step += 1
    for i, p in enumerate(PROMPTS):
        ids = tok(p).input_ids
        assert final[f"s{i}"].token_ids == hf_greedy(model, ids, lens[i]), p
    pool_whole(llm)


def test_stops_at_eos_like_transformers(llm, hf, pool_whole):
    """Without ignore_eos the output ends at the first EOS (included in token_ids, not in text)."""
    model, tok = hf
    prompts = PROMPTS[:6]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=100))
    for p, out in zip(prompts, outs, strict=True):
        ids = tok(p).input_ids
        ref = hf_greedy(model, ids, min(100, 128 - len(ids)))
        if 2 in ref:
            ref = ref[: ref.index(2) + 1]
            assert out.outputs[0].finish_reason == "stop"
        else:
            assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == ref
        assert "</s>" not in out.outputs[0].text
    pool_whole(llm)


def _invariance_workload(tok) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(7)
    base = " ".join(PROMPTS).split()
    prompts, params = [], []
    for _ in range(64):
        words = rng.randint(1, 24)
        start = rng.randint(0, len(base) - words)
        ids = tok(" ".join(base[start : start + words])).input_ids[:70]
        prompts.append(ids)
        params.append(
            SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 20), ignore_eos=True)
        )
    return prompts, params


@pytest.fixture(scope="module")
def invariance(aidreams_path, hf):
    """The 64-request workload and its greedy tokens when all run together (ample KV)."""
    _, tok = hf
    prompts, params = _invariance_workload(tok)
    llm = LLM(aidreams_path, block_size=16, max_num_seqs=64, num_kv_blocks=512)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    return llm, prompts, params, together


@pytest.mark.parametrize("policy", POLICIES)
def test_batch_invariance_64_requests(aidreams_path, invariance, policy, pool_whole):
    llm, prompts, params, together = invariance
    pool_whole(llm)
    if policy != "fcfs":  # the same 64 requests, ordered by another policy: same tokens
        llm = LLM(
            aidreams_path,
            block_size=16,
            max_num_seqs=64,
            num_kv_blocks=512,
            scheduling_policy=policy,
        )
        got = llm.generate(prompts, params, tenant=_tenants(64), priority=_priorities(64))
        assert [o.outputs[0].token_ids for o in got] == together
        pool_whole(llm)
    alone = [
        llm.generate([p], [sp])[0].outputs[0].token_ids
        for p, sp in zip(prompts, params, strict=True)
    ]
    assert together == alone
    assert [len(t) for t in together] == [sp.max_tokens for sp in params]
    pool_whole(llm)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_batch_invariance_under_preemption(
    aidreams_path, invariance, prefix_caching, policy, pool_whole
):
    """So few KV blocks (16 x 16 tokens for 64 requests) that running requests must be
    preempted and recomputed; tokens still equal the ample-cache run."""
    _, prompts, params, together = invariance
    small = LLM(
        aidreams_path,
        block_size=16,
        num_kv_blocks=16,
        max_num_seqs=64,
        enable_prefix_caching=prefix_caching,
        scheduling_policy=policy,
    )
    outs = small.generate(prompts, params, tenant=_tenants(64), priority=_priorities(64))
    got = [o.outputs[0].token_ids for o in outs]
    assert small.stats()["num_preemptions"] > 0
    assert got == together
    pool_whole(small)
