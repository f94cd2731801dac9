"""LLM / LLMEngine API on aidreams-260k: bad input, chat, stop strings, logprobs, seeds, abort,
length caps, streaming deltas."""

from __future__ import annotations

import pytest
from prefixgate.engine import LLM, CompletionOutput, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["I sense the nodes", "A gentle hum", "The dreamer wakes inside the code and"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def llm(aidreams_path):
    return LLM(aidreams_path, num_kv_blocks=256)


def _bad_inputs(llm: LLM):
    """(description, callable) pairs that must raise ValueError or TypeError."""
    eng = llm.engine
    long_prompt = [1] + [300] * llm.max_model_len
    return [
        ("empty text prompt", lambda: eng.add_request("bad-1", "", GREEDY)),
        ("empty id prompt", lambda: eng.add_request("bad-2", [], GREEDY)),
        ("prompt > max_model_len", lambda: eng.add_request("bad-3", long_prompt, GREEDY)),
        (
            "prompt == max_model_len",
            lambda: eng.add_request("bad-3b", long_prompt[: llm.max_model_len], GREEDY),
        ),
        ("token id outside vocab", lambda: eng.add_request("bad-4", [1, 99999], GREEDY)),
        ("prompt of wrong type", lambda: eng.add_request("bad-5", 42, GREEDY)),
        ("max_tokens < 1", lambda: eng.add_request("bad-6", "hi", SamplingParams(max_tokens=0))),
        (
            "temperature < 0",
            lambda: eng.add_request("bad-7", "hi", SamplingParams(temperature=-1.0)),
        ),
        ("top_p = 0", lambda: eng.add_request("bad-8", "hi", SamplingParams(top_p=0.0))),
        ("top_p > 1", lambda: eng.add_request("bad-9", "hi", SamplingParams(top_p=1.5))),
        ("stop of wrong type", lambda: eng.add_request("bad-10", "hi", SamplingParams(stop=[3]))),
        ("params of wrong type", lambda: eng.add_request("bad-11", "hi", {"max_tokens": 3})),
        ("cache_salt of wrong type", lambda: eng.add_request("bad-12", "hi", GREEDY, cache_salt=5)),
        ("duplicate request id", lambda: eng.add_request("good-0", "hi", GREEDY)),
        ("unknown request id to abort", lambda: eng.abort_request("nope")),
        ("generate: params list of wrong length", lambda: llm.generate(["a", "b"], [GREEDY])),
    ]


def test_bad_input_raises_and_disturbs_nothing(llm, pool_whole):
    reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"good-{i}", p, GREEDY)
    final: dict[str, CompletionOutput] = {}
    for _ in range(3):
        for out in eng.step():
            final.setdefault(out.request_id, CompletionOutput(out.request_id)).add(out)
    for what, call in _bad_inputs(llm):
        with pytest.raises((ValueError, TypeError)):
            call()
        eng.check_invariants()
        assert eng.stats()["num_running"] + eng.stats()["num_waiting"] == len(PROMPTS), what
    while eng.has_unfinished_requests():
        for out in eng.step():
            final.setdefault(out.request_id, CompletionOutput(out.request_id)).add(out)
    assert [final[f"good-{i}"].token_ids for i in range(len(PROMPTS))] == reference
    pool_whole(llm)


def test_generate_validates_everything_before_queuing(llm, pool_whole):
    with pytest.raises(ValueError):
        llm.generate(["fine", ""], GREEDY)
    with pytest.raises(TypeError):
        llm.generate(None, GREEDY)
    pool_whole(llm)


def test_prompt_forms_and_order(llm, pool_whole):
    tok = llm.tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    by_text = llm.generate(PROMPTS, GREEDY)
    by_ids = llm.generate(ids, GREEDY)
    one_text = llm.generate(PROMPTS[1], GREEDY)
    one_ids = llm.generate(ids[1], GREEDY)
    assert [o.prompt for o in by_text] == PROMPTS
    assert [o.prompt_token_ids for o in by_text] == ids
    assert [o.outputs[0].token_ids for o in by_text] == [o.outputs[0].token_ids for o in by_ids]
    assert (
        one_text[0].outputs[0].token_ids
        == one_ids[0].outputs[0].token_ids
        == by_text[1].outputs[0].token_ids
    )
    assert by_ids[0].prompt is None
    pool_whole(llm)


def test_generation_capped_at_max_model_len(llm, pool_whole):
    prompt = [1] + [300] * (llm.max_model_len - 6)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].finish_reason == "length"
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[
        0
    ]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == llm.max_model_len
    pool_whole(llm)


def test_stop_string_and_stop_token(llm, pool_whole):
    free = llm.generate(PROMPTS[0], GREEDY)[0].outputs[0]
    stop = free.text[5:9]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, stop=[stop]))[0]
    c = out.outputs[0]
    assert c.text == free.text[: free.text.index(stop)]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    stop_id = free.token_ids[3]
    out = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id])
    )[0]
    c = out.outputs[0]
    assert c.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id
    pool_whole(llm)


def test_chat_applies_template(llm, pool_whole):
    messages = [
        {"role": "system", "content": "You dream."},
        {"role": "user", "content": "I sense the nodes"},
    ]
    chat = llm.chat(messages, GREEDY)[0]
    plain = llm.generate("You dream.\n\nI sense the nodes", GREEDY)[0]
    assert chat.prompt_token_ids == plain.prompt_token_ids
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    two = llm.chat([messages, messages[1:]], GREEDY)
    assert len(two) == 2 and two[0].outputs[0].token_ids == chat.outputs[0].token_ids
    with pytest.raises(ValueError):
        llm.chat([], GREEDY)
    pool_whole(llm)


def test_logprobs(llm, pool_whole):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3))[0]
    lps = out.outputs[0].logprobs
    assert lps is not None and len(lps) == 4
    for tok, lp in zip(out.outputs[0].token_ids, lps, strict=True):
        assert lp.sampled.token_id == tok and lp.sampled.logprob <= 0.0
        assert len(lp.top) == 3 and lp.top[0].token_id == tok  # greedy: the top-1 token
    assert llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].logprobs is None
    pool_whole(llm)


def test_seeded_sampling_is_batch_independent(llm, pool_whole):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], p)[0].outputs[0].token_ids
    batch = llm.generate(
        PROMPTS + [PROMPTS[0]],
        [SamplingParams(temperature=0.8, max_tokens=10)] * len(PROMPTS) + [p],
    )
    assert batch[-1].outputs[0].token_ids == alone
    pool_whole(llm)


def test_abort_frees_blocks_and_reports(llm, pool_whole):
    eng = llm.engine
    eng.add_request(
        "ab-1", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    )
    eng.add_request("ab-2", PROMPTS[0], GREEDY)
    eng.step()
    eng.step()
    out = eng.abort_request("ab-1")
    assert out.finished and out.finish_reason == "abort"
    with pytest.raises(ValueError):
        eng.abort_request("ab-1")
    while eng.has_unfinished_requests():
        eng.step()
    pool_whole(llm)


def test_outputs_hold_only_what_the_step_added(llm, pool_whole):
    # no output copies the request's whole ids, logprobs or text; the timeline
    # rides on the first output with tokens and on the last only
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=2)
    eng.add_request("only-new", PROMPTS[1], params)
    req = eng.scheduler.requests["only-new"]
    outs = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.delta_token_ids is not req.output_token_ids
            assert len(out.delta_token_ids) <= 1 and len(out.logprobs) == len(out.delta_token_ids)
            outs.append(out)
    with_tokens = [i for i, o in enumerate(outs) if o.delta_token_ids]
    assert [i for i, o in enumerate(outs) if o.metrics] == sorted({with_tokens[0], len(outs) - 1})
    assert req.new_text == "" and req.new_logprobs == []  # handed over, not kept
    whole = CompletionOutput()
    for out in outs:
        whole.add(out)
    ref = llm.generate([PROMPTS[1]], params)[0].outputs[0]
    assert (whole.token_ids, whole.text, len(whole.logprobs)) == (ref.token_ids, ref.text, 9)
    pool_whole(llm)


def test_streamed_deltas_add_up(llm, pool_whole):
    eng = llm.engine
    eng.add_request("st-1", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=20))
    text, ids, last = "", [], None
    whole = CompletionOutput("st-1")
    while eng.has_unfinished_requests():
        for out in eng.step():
            text += out.delta_text
            ids += out.delta_token_ids
            whole.add(out)
            assert whole.text == text and whole.token_ids == ids
            last = out
    assert last is not None and last.finished and whole.finished
    assert (
        ids
        == llm.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=20))[0]
        .outputs[0]
        .token_ids
    )
    m = last.metrics
    assert (
        m["arrival"] <= m["first_scheduled"] <= m["first_token"] <= m["last_token"] <= m["finished"]
    )
    pool_whole(llm)


def test_default_preset_runs_without_files(pool_whole):
    llm = LLM(num_kv_blocks=64)
    out = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    pool_whole(llm)


def test_max_model_len_fits_the_kv_cache(aidreams_path, pool_whole):
    """A KV cache smaller than the model's context lowers max_model_len (warning), so a request
    without max_tokens still finishes; an explicit max_model_len over capacity is an error."""
    small = LLM(aidreams_path, num_kv_blocks=4, block_size=16)  # 64 tokens < context 128
    assert small.max_model_len == 64
    out = small.generate(
        "I sense the nodes", SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    )[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 64
    pool_whole(small)
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        LLM(aidreams_path, num_kv_blocks=4, block_size=16, max_model_len=100)
