"""The official ``openai`` Python client against the prefixgate gateway (a drop-in server).

    prefixgate serve --port 8000
    PREFIXGATE_BASE_URL=http://127.0.0.1:8000/v1 python examples/openai_client.py

Shows: chat completion, legacy completion, streaming with ``stream_options.include_usage``,
and the prefix cache at work: the same system prompt sent twice gives
``usage.prompt_tokens_details.cached_tokens > 0`` the second time.
"""

from __future__ import annotations

import os

from _unreachable import exit_if_unreachable
from openai import APIConnectionError, AuthenticationError, OpenAI

BASE_URL = os.environ.get("PREFIXGATE_BASE_URL", "http://127.0.0.1:8000/v1")
# A gateway started without --api-key accepts any key; the client insists on having one.
API_KEY = os.environ.get("PREFIXGATE_API_KEY", "unused")

SYSTEM = "You are a storyteller: answer with a short, vivid, dreamlike story."


def main() -> None:
    client = OpenAI(base_url=BASE_URL, api_key=API_KEY, max_retries=2)
    model = client.models.list().data[0].id
    print(f"model: {model}")

    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Tell me about a dream."},
    ]
    first = client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0
    )
    print(
        f"chat: {first.choices[0].message.content!r} (finish_reason={first.choices[0].finish_reason})"
    )

    second = client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0
    )
    details = second.usage.prompt_tokens_details
    cached = details.cached_tokens if details else 0
    print(
        f"again: {cached} of {second.usage.prompt_tokens} prompt tokens served from the prefix cache"
    )
    print(
        f"same greedy text: {first.choices[0].message.content == second.choices[0].message.content}"
    )

    comp = client.completions.create(
        model=model, prompt="I sense the nodes", max_tokens=16, temperature=0
    )
    print(f"completion: {comp.choices[0].text!r}")

    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    print("stream: ", end="", flush=True)
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage is not None:  # the last chunk, only with include_usage
            usage = chunk.usage
    print()
    if usage is not None:
        print(
            f"stream usage: {usage.prompt_tokens} prompt, {usage.completion_tokens} completion tokens"
        )


if __name__ == "__main__":
    with exit_if_unreachable(APIConnectionError, BASE_URL, unauthorized=AuthenticationError):
        main()
