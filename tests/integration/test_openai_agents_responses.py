"""openai-agents' Responses mode (``OpenAIResponsesModel``) against a live gateway on
aidreams-260k: every call of it sends ``include: []`` and other empty fields, which were each
a 400 "Unrecognized request argument supplied"; now they are taken as absent and the agent
gets its answer (greedy: the prompt "Dream" ends with the model's EOS within 100 tokens)."""

from __future__ import annotations

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
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    agent = agents.Agent(
        name="dreamer",
        instructions="Be brief.",
        model=agents.OpenAIResponsesModel(MODEL, client),
        model_settings=agents.ModelSettings(max_tokens=100, temperature=0),
    )
    result = agents.Runner.run_sync(agent, "Dream")
    assert isinstance(result.final_output, str) and result.final_output
    wait_idle(server, pool_whole)  # the agent's calls leave the block pool whole
