"""Turns that stay cached: a recorded 30-turn agent trace (tool calls and tool results every
third turn) replayed through the ``anthropic`` and ``openai`` clients against the gateway on
the built-in tiny-random model. Turn N+1's prompt strictly extends turn N's, so each turn reads
from the prefix cache every whole KV block of the previous turn's prompt: the figure is the
share of turns that do (docs/prompt-caching.md).
"""

from __future__ import annotations

import json

import pytest

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("prefixgate.engine.async_engine")

from prefixgate.engine import AsyncEngine, EngineConfig  # noqa: E402
from prefixgate.gateway.app import create_app  # noqa: E402
from prefixgate.gateway.http.server import BackgroundServer  # noqa: E402
from prefixgate.gateway.local.serving import LOCAL  # noqa: E402
from prefixgate.gateway.settings import GatewaySettings  # noqa: E402
from support.gateway import openai_client, wait_idle  # noqa: E402

TURNS = 30
BLOCK = 16
SYSTEM = "You are a careful assistant with a weather tool. Answer briefly. " * 3
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def server():
    def make():
        engine = AsyncEngine(EngineConfig(model=None, num_kv_blocks=512, max_model_len=2048))
        return create_app(engine, GatewaySettings(model_name="tiny", poll_s=0.02))

    srv = BackgroundServer(make).__enter__()
    yield srv
    srv.call(srv.app[LOCAL].engine.shutdown)
    srv.close()


def _reused(prompts: list[int], reads: list[int]) -> float:
    """Share of turns after the first reading every whole block of the previous prompt."""
    hits = [reads[i] >= prompts[i - 1] // BLOCK * BLOCK for i in range(1, len(prompts))]
    return sum(hits) / len(hits)


def test_anthropic_trace_turns_reuse_the_previous_prompt(server, pool_whole):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    messages: list[dict] = []
    prompts, reads = [], []
    for turn in range(TURNS):
        if turn % 3 == 2:  # a recorded tool call and its result
            call_id = f"toolu_{turn:04d}"
            messages.append(
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Let me check."},
                        {"type": "tool_use", "id": call_id, "name": "get_weather",
                         "input": {"city": f"City{turn}"}},
                    ],
                }
            )  # fmt: skip
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": call_id, "content": "Sunny, 21 C"}
                    ],
                }
            )
        else:
            messages.append({"role": "user", "content": f"Question {turn}: is it warm today?"})
        reply = client.messages.create(
            model="tiny",
            max_tokens=4,
            system=SYSTEM,
            tools=[WEATHER],
            tool_choice={"type": "none"},
            messages=messages,
            cache_control={"type": "ephemeral"},
            extra_body={"temperature": 0},
        )
        u = reply.usage
        total = u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens
        prompts.append(total)
        reads.append(u.cache_read_input_tokens)
        messages.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
    share = _reused(prompts, reads)
    print(
        f"anthropic trace: {share:.1%} of {TURNS - 1} turns reuse the previous prompt; last prompt {prompts[-1]} tokens, read {reads[-1]}"
    )
    assert share >= 0.99, list(zip(prompts, reads, strict=True))
    wait_idle(server, pool_whole, pinned_ok=True)


def test_openai_trace_turns_reuse_the_previous_prompt(server, pool_whole):
    client = openai_client(server)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"]}}  # fmt: skip
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    prompts, reads = [], []
    for turn in range(TURNS):
        if turn % 3 == 2:
            call_id = f"call_{turn:04d}"
            args = json.dumps({"city": f"City{turn}"})
            messages.append(
                {
                    "role": "assistant",
                    "content": "Let me check.",
                    "tool_calls": [{"id": call_id, "type": "function",
                                    "function": {"name": "get_weather", "arguments": args}}],
                }
            )  # fmt: skip
            messages.append({"role": "tool", "tool_call_id": call_id, "content": "Sunny, 21 C"})
        else:
            messages.append({"role": "user", "content": f"Question {turn}: is it warm today?"})
        reply = client.chat.completions.create(
            model="tiny",
            max_tokens=4,
            temperature=0,
            tools=[tool],
            tool_choice="none",
            messages=messages,
            extra_body={"prompt_cache_options": {"mode": "implicit"}},
        )
        prompts.append(reply.usage.prompt_tokens)
        reads.append(reply.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    share = _reused(prompts, reads)
    print(
        f"openai trace: {share:.1%} of {TURNS - 1} turns reuse the previous prompt; last prompt {prompts[-1]} tokens, read {reads[-1]}"
    )
    assert share >= 0.99, list(zip(prompts, reads, strict=True))
    wait_idle(server, pool_whole, pinned_ok=True)
