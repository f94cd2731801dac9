"""Anthropic's structural rules of a ``/v1/messages`` conversation (``anthropic_models.
check_turns``): a turn without content, an empty text block, a ``tool_result`` without a
``tool_use`` of that id in the previous turn, a ``tool_use`` left unanswered, a ``tool_result``
after text, a repeated ``tool_use`` id, a first turn that is not the user's — each a 400 in
Anthropic's shape whose message starts with the field, in local mode and through the proxy
(the official ``anthropic`` client), for ``messages`` and ``count_tokens`` alike. A valid
conversation and consecutive user turns (Anthropic combines them) still pass."""

from __future__ import annotations

import anthropic
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings

Q = {"role": "user", "content": "q"}
USE = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"}
CALLED = {"role": "assistant", "content": [{"type": "text", "text": "calling"}, USE]}
TOOLS = [{"name": "f", "input_schema": {"type": "object", "properties": {}}}]

# (messages, the field the message starts with)
BAD = [
    ([{"role": "user", "content": ""}], "messages.0: all messages must have non-empty content"),
    ([{"role": "user", "content": []}], "messages.0: all messages must have non-empty content"),
    ([Q, {"role": "assistant", "content": ""}, Q], "messages.1: all messages must have non-empty"),
    ([{"role": "user", "content": [{"type": "text", "text": ""}]}],
     "messages.0.content.0.text: text content blocks must be non-empty"),
    ([{"role": "user", "content": [RESULT]}],
     "messages.0.content.0.tool_use_id: unexpected tool_use_id found in tool_result blocks"),
    ([Q, {"role": "assistant", "content": "no call"}, {"role": "user", "content": [RESULT]}],
     "messages.2.content.0.tool_use_id: unexpected tool_use_id"),
    ([Q, CALLED, {"role": "user", "content": [RESULT]}, {"role": "assistant", "content": "x"},
      {"role": "user", "content": [RESULT]}],
     "messages.4.content.0.tool_use_id: unexpected tool_use_id"),  # answered two turns late
    ([Q, CALLED, Q], "messages.1: tool_use ids were found without tool_result blocks"),
    ([Q, CALLED, {"role": "user", "content": [{"type": "text", "text": "t"}, RESULT]}],
     "messages.2.content.1: tool_result blocks must come first"),
    ([Q, {"role": "assistant", "content": [USE, USE]},
      {"role": "user", "content": [RESULT]}], "messages.1.content.1.id: tool_use ids must be unique"),
    ([{"role": "assistant", "content": "hello"}, Q],
     "messages.0.role: the first message must use the user role"),
    # a lone assistant turn is told as not the user's first, not as a final assistant turn
    ([{"role": "assistant", "content": "hello"}],
     "messages.0.role: the first message must use the user role"),
    ([{"role": "user", "content": [USE]}], "messages.0.content.0: tool_use blocks belong to assistant"),
    # the block's discriminator tag is not part of the path (it read content.0.text.foo)
    ([{"role": "user", "content": [{"type": "text", "text": "t", "foo": 1}]}],
     "Unrecognized request argument supplied: messages.0.content.0.foo"),
]  # fmt: skip
# (the fake engine's template has no tool role: valid tool turns are rendered by the real
# model's template in tests/integration/test_messages_api.py and test_messages_turns.py)
GOOD = [
    [Q, {"role": "assistant", "content": "a"}, {"role": "user", "content": [{"type": "text",
                                                                            "text": "b"}]}],
    [Q, Q],  # consecutive user turns: Anthropic combines them
]  # fmt: skip


@pytest.fixture(params=["local", "proxy"])
def url(request, serve_fake):
    srv, _ = serve_fake(GatewaySettings(model_name="fake", tool_call_parser="hermes"))
    if request.param == "local":
        yield srv.url
        return
    with BackgroundServer(lambda: create_proxy_app([srv.url], GatewaySettings())) as gw:
        yield gw.url


@pytest.mark.parametrize(("messages", "want"), BAD)
def test_a_conversation_against_anthropic_rules_is_a_400_naming_the_field(url, messages, want):
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    for call in (
        lambda: client.messages.create(model="fake", max_tokens=4, messages=messages, tools=TOOLS),
        lambda: client.messages.create(
            model="fake", max_tokens=4, messages=messages, tools=TOOLS, stream=True
        ),
        lambda: client.messages.count_tokens(model="fake", messages=messages, tools=TOOLS),
    ):
        with pytest.raises(anthropic.BadRequestError) as info:
            call()
        body = info.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        assert body["error"]["message"].startswith(want), body
        # it said "... except for the optional final assistant message", a turn refused here
        assert "final assistant" not in body["error"]["message"], body


@pytest.mark.parametrize("messages", GOOD)
def test_valid_conversations_pass(url, messages):
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    m = client.messages.create(model="fake", max_tokens=4, messages=messages, tools=TOOLS)
    assert m.type == "message"
    assert client.messages.count_tokens(model="fake", messages=messages, tools=TOOLS).input_tokens


@pytest.mark.parametrize(
    "choice", [{"type": "any"}, {"type": "auto"}, {"type": "tool", "name": "f"}]
)
def test_tool_choice_without_tools_is_refused_in_anthropic_words(url, choice):
    # it said "tool_choice: 'required' needs tools" (OpenAI's words; a new user's probe)
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="fake", max_tokens=4, messages=[Q], tool_choice=choice)
    body = info.value.body
    assert body["error"]["message"].startswith("tool_choice: may only be specified"), body
