"""openai-agents' Responses mode (``OpenAIResponsesModel``) against a live gateway on
aidreams-260k: every call of it sends ``include: []`` and other empty fields, which were each
a 400 "Unrecognized request argument supplied"; now they are taken as absent and the agent
gets its answer (greedy: the prompt "Dream" ends with the model's EOS within 100 tokens)."""

from __future__ import annotations

import asyncio
import gc

import pytest
from support.gateway import serve_aidreams, wait_idle

pytest.importorskip("prefixgate.engine.async_engine")
agents = pytest.importorskip("agents")

MODEL = "aidreams-260k"


@pytest.fixture(scope="module")
def server(aidreams_path):
    yield from serve_aidreams(aidreams_path, model_name=MODEL)


def test_an_agent_in_responses_mode_gets_its_answer(server, pool_whole):
    url = server.url
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)

    async def run() -> agents.RunResult:
        # the client is closed on the loop its connections belong to (left open, it closed
        # itself on whatever loop ran when it was collected, failing a later test)
        async with AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
            agent = agents.Agent(
                name="dreamer",
                instructions="Be brief.",
                model=agents.OpenAIResponsesModel(MODEL, client),
                model_settings=agents.ModelSettings(max_tokens=100, temperature=0),
            )
            return await agents.Runner.run(agent, "Dream")

    result = asyncio.run(run())
    assert isinstance(result.final_output, str) and result.final_output
    wait_idle(server, pool_whole)  # the agent's calls leave the block pool whole


def _agent_answer(url: str) -> str:
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)

    async def run() -> agents.RunResult:
        async with AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
            agent = agents.Agent(
                name="dreamer",
                instructions="Be brief.",
                model=agents.OpenAIResponsesModel(MODEL, client),
                model_settings=agents.ModelSettings(max_tokens=100, temperature=0),
            )
            return await agents.Runner.run(agent, "Dream")

    return asyncio.run(run()).final_output


def test_an_agent_through_a_proxy_gets_local_mode_s_answer(server, pool_whole):
    """The proxy relays the Responses API as a chat (``proxy/responses_relay.py``): the
    agent's greedy answer is the one it gets from the gateway directly."""
    from prefixgate.gateway.app import create_proxy_app
    from prefixgate.gateway.http.server import BackgroundServer
    from prefixgate.gateway.settings import GatewaySettings

    local = _agent_answer(server.url)
    with BackgroundServer(lambda: create_proxy_app([server.url], GatewaySettings())) as gw:
        proxied = _agent_answer(gw.url)
    assert isinstance(proxied, str) and proxied == local != ""
    wait_idle(server, pool_whole)


def test_the_agents_client_is_not_left_to_a_later_loop(server):
    """Runs after the test above: an ``AsyncOpenAI`` left open there closes itself when
    collected, on the loop running then, and its connections' loop is gone ("Event loop is
    closed"), which failed an unrelated async test of a whole-suite run."""
    errors: list[dict] = []

    async def collect() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        gc.collect()
        await asyncio.sleep(0.05)  # what a collected client scheduled runs now

    asyncio.run(collect())
    assert errors == []
