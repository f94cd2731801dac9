"""``"strict": true`` tools with ``tool_choice="auto"`` through the real gateway
(``--tool-call-parser hermes``) on aidreams-260k, driven by the official ``openai`` client:
every tool call returned, whole or streamed, validates against its tool's schema over several
seeds and temperatures; the text before the call is content; the block pool ends whole.

aidreams never writes ``<tool_call>`` itself: ``support.steer`` scripts the opening of each
constrained answer ("Let me see.<tool_call>", and for get_weather, which aidreams never picks
of its own accord, the call's head up to ``"arguments": ``); the rest is the model's own
sampling under the structural tag's mask. (Checked by hand: with get_weather not strict, its
arguments under the same steering fail the schema.)"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytest.importorskip("prefixgate.engine.async_engine")

from prefixgate.gateway.local.serving import LOCAL  # noqa: E402
from support.gateway import hermes_fixtures, wait_idle  # noqa: E402
from support.schemas import STRICT_WEATHER_PARAMS as WEATHER  # noqa: E402
from support.schemas import TIME_PARAMS as TIME
from support.steer import steer_opening  # noqa: E402

MODEL = "aidreams-260k"
OPENING = "Let me see.<tool_call>"
WEATHER_OPENING = OPENING + '\n{"name": "get_weather", "arguments": '
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": p, "strict": True}}
    for n, p in PARAMS.items()
]
MSGS = [{"role": "user", "content": "Weather?"}]

server, client = hermes_fixtures(MODEL)


@pytest.fixture(params=[OPENING, WEATHER_OPENING], ids=["model_picks", "get_weather"])
def steered(server, monkeypatch, request):
    tok = server.app[LOCAL].engine.tokenizer
    ids = tok.encode_plain(request.param)
    assert tok.decode(ids) == request.param
    return steer_opening(monkeypatch, ids)


def _validate(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), PARAMS[name])


@pytest.mark.parametrize("parallel", [False, None])
def test_every_returned_call_validates(client, server, steered, pool_whole, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    calls = 0
    for temperature in (0.7, 1.0, 1.3):
        r = client.chat.completions.create(
            model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="auto", n=4, seed=11,
            temperature=temperature, max_tokens=120, **extra,
        )  # fmt: skip
        for c in r.choices:
            for call in c.message.tool_calls or []:
                assert call.id.startswith("call_") and call.type == "function"
                _validate(call.function.name, call.function.arguments)
                calls += 1
            if c.message.tool_calls:
                # free text may follow a call until max_tokens ("length") unless one call ends it
                assert c.finish_reason in (("tool_calls",) if parallel is False else
                                           ("tool_calls", "length"))  # fmt: skip
                content = (c.message.content or "").strip()
                if parallel is False:  # the answer ends with the one call
                    assert len(c.message.tool_calls) == 1 and content == "Let me see."
                else:  # free text may follow a call
                    assert content.startswith("Let me see."), content
    assert calls >= 9, calls  # of 12 answers: most finish their call within max_tokens
    wait_idle(server, pool_whole)


def test_streamed_calls_validate(client, server, steered, pool_whole):
    complete = 0
    for seed in range(6):
        stream = client.chat.completions.create(
            model=MODEL, messages=MSGS, tools=TOOLS, temperature=1.0, seed=seed,
            max_tokens=120, stream=True, parallel_tool_calls=False,
        )  # fmt: skip
        slots: dict[int, dict] = {}
        content, finish = "", None
        for chunk in stream:
            d = chunk.choices[0].delta
            finish = chunk.choices[0].finish_reason or finish
            content += d.content or ""
            for tc in d.tool_calls or []:
                slot = slots.setdefault(tc.index, {"name": "", "arguments": ""})
                if tc.function and tc.function.name:
                    slot["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
        assert sorted(slots) == list(range(len(slots)))
        for slot in slots.values():
            _validate(slot["name"], slot["arguments"])
        if slots:
            complete += 1
            assert finish == "tool_calls" and content.strip() == "Let me see."
    assert complete >= 4, complete
    wait_idle(server, pool_whole)


def test_strict_auto_with_response_format_is_a_400(client, server, pool_whole):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=5,
            response_format={"type": "json_object"},
        )  # fmt: skip
    assert err.value.body["param"] == "response_format"
    assert "strict tools" in err.value.body["message"]
    wait_idle(server, pool_whole)


def test_strict_not_a_boolean_is_a_400(client, server, pool_whole):
    bad = [{"type": "function", "function": {"name": "f", "parameters": TIME, "strict": "yes"}}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MSGS, tools=bad, max_tokens=5)
    assert err.value.body["param"] == "tools[0].function.strict"
    wait_idle(server, pool_whole)
