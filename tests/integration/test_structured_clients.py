"""Real clients against ``prefixgate serve`` (a process) on aidreams-260k: openai-python's
``chat.completions.parse`` with a pydantic model, LangChain's ``ChatOpenAI``
(``with_structured_output`` in both methods, ``bind_tools``), pydantic-ai's agents (chat
completions with a tool and ``NativeOutput``, and ``/v1/messages``) and LiteLLM's
``completion`` (``openai/`` and ``anthropic/``) end to end."""

from __future__ import annotations

import subprocess
import time
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from support.schemas import Pet
from support.serve_process import SERVE, read_until_ready, terminate

pytest.importorskip("prefixgate.engine.async_engine")

MODEL = "aidreams-260k"


@pytest.fixture(scope="module")
def serve_url(aidreams_path):
    proc = subprocess.Popen(
        [
            *SERVE, "--model", aidreams_path, "--served-model-name", MODEL, "--port", "0",
            "--num-kv-blocks", "128", "--tool-call-parser", "hermes",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    try:
        url, log, _ = read_until_ready(proc, deadline)
        assert url, "".join(log)
        while httpx.get(url + "/ready").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        yield url
    finally:
        terminate(proc)


def _pool_whole(url: str) -> None:
    """The server's engine ends idle, every KV block free (read from /metrics)."""
    deadline = time.monotonic() + 20
    values: dict[str, float] = {}
    while time.monotonic() < deadline:
        values = {
            line.split()[0]: float(line.split()[1])
            for line in httpx.get(url + "/metrics").text.splitlines()
            if line.startswith("prefixgate_") and " " in line
        }
        if (
            values["prefixgate_kv_blocks_used"] == 0
            and values["prefixgate_engine_running_requests"] == 0
            and values["prefixgate_engine_waiting_requests"] == 0
            and values["prefixgate_kv_blocks_free"] == values["prefixgate_kv_blocks_total"]
        ):
            return
        time.sleep(0.1)
    raise AssertionError(f"the pool is not whole after the requests ended: {values}")


def test_openai_parse_with_pydantic_model(serve_url):
    client = openai.OpenAI(base_url=serve_url + "/v1", api_key="none", max_retries=0)
    for seed in range(3):
        r = client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": "A pet"}],
            response_format=Pet,
            temperature=1.0,
            seed=seed,
            max_tokens=100,
        )
        pet = r.choices[0].message.parsed
        assert isinstance(pet, Pet), r
        assert pet.kind in ("cat", "dog", "owl") and 0 <= pet.age <= 30
    _pool_whole(serve_url)


def test_langchain_structured_output_and_tools(serve_url):
    pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL, base_url=serve_url + "/v1", api_key="none", temperature=0, max_tokens=100,
        max_retries=0,
    )  # fmt: skip
    for method in ("json_schema", "function_calling"):
        pet = llm.with_structured_output(Pet, method=method).invoke("A pet")
        assert isinstance(pet, Pet), (method, pet)

    class WeatherArgs(BaseModel):
        city: str = Field(max_length=8)  # bounded: a tiny model may never close a string
        unit: Literal["c", "f"]

    @tool(args_schema=WeatherArgs)
    def get_weather(city: str, unit: Literal["c", "f"]) -> str:
        """Weather of a city."""
        return "cold"

    @tool
    def get_time(tz: Literal["UTC", "CET"]) -> str:
        """Time in a zone."""
        return "noon"

    for choice in ("get_weather", "any"):
        msg = llm.bind_tools(
            [get_weather, get_time], tool_choice=choice, parallel_tool_calls=False
        ).invoke("Weather?")
        assert msg.tool_calls, msg
        call = msg.tool_calls[0]
        assert call["name"] in ("get_weather", "get_time") and call["id"].startswith("call_")
        if choice == "get_weather":
            assert call["name"] == "get_weather"
            assert set(call["args"]) == {"city", "unit"} and call["args"]["unit"] in ("c", "f")
        # the tool result goes back through the chat template as a tool message
        result = (get_weather if call["name"] == "get_weather" else get_time).invoke(call)
        follow = llm.invoke(["Weather?", msg, result])
        assert isinstance(follow.content, str)
    _pool_whole(serve_url)


def test_pydantic_ai_agents_on_both_dialects(serve_url):
    """pydantic-ai's agents as its users write them: ``OpenAIChatModel`` (chat completions)
    with a tool (its default ``tool_choice: auto``, served with ``--tool-call-parser``) and
    ``NativeOutput`` (``response_format`` json_schema: an instance back), and
    ``AnthropicModel`` (``/v1/messages``)."""
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.anthropic import AnthropicProvider
    from pydantic_ai.providers.openai import OpenAIProvider

    settings = {"max_tokens": 24, "temperature": 0.0}
    chat = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=serve_url + "/v1", api_key="x"))
    agent = Agent(chat, output_type=str, model_settings=settings)

    @agent.tool_plain
    def get_time(tz: Literal["UTC", "CET"]) -> str:
        """Time in a zone."""
        return "noon"

    run = agent.run_sync("What time is it?")
    assert isinstance(run.output, str)
    assert 0 < run.usage().output_tokens <= 24 * max(1, run.usage().requests)
    typed = Agent(chat, output_type=NativeOutput(Pet), model_settings={"max_tokens": 100})
    assert isinstance(typed.run_sync("A pet").output, Pet)
    messages = AnthropicModel(MODEL, provider=AnthropicProvider(base_url=serve_url, api_key="x"))
    run = Agent(messages, output_type=str, model_settings=settings).run_sync("Hello")
    assert isinstance(run.output, str) and 0 < run.usage().output_tokens <= 24
    _pool_whole(serve_url)


def test_litellm_completion_through_openai_and_anthropic_routes(serve_url, monkeypatch):
    """LiteLLM's ``completion`` as a proxy user calls it: ``openai/`` (chat completions,
    whole and streamed, the same text at temperature 0; ``response_format`` a pydantic model)
    and ``anthropic/`` (``/v1/messages``), usage as the server counted it."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list
    litellm = pytest.importorskip("litellm")

    ask = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 12, "temperature": 0}
    openai_route = {"model": f"openai/{MODEL}", "api_base": serve_url + "/v1", "api_key": "x"}
    whole = litellm.completion(**openai_route, **ask)
    text = whole.choices[0].message.content
    assert isinstance(text, str) and whole.choices[0].finish_reason in ("stop", "length")
    assert 0 < whole.usage.completion_tokens <= 12
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in litellm.completion(**openai_route, **ask, stream=True)
    )
    assert streamed == text
    pet = litellm.completion(
        **openai_route, messages=[{"role": "user", "content": "A pet"}], response_format=Pet,
        max_tokens=100,
    )  # fmt: skip
    assert Pet.model_validate_json(pet.choices[0].message.content)
    anthropic_route = {"model": f"anthropic/{MODEL}", "api_base": serve_url, "api_key": "x"}
    msg = litellm.completion(**anthropic_route, **ask)
    assert isinstance(msg.choices[0].message.content, str)
    assert 0 < msg.usage.completion_tokens <= 12
    _pool_whole(serve_url)
