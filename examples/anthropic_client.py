"""The official ``anthropic`` Python client against the prefixgate gateway (Messages API).

    prefixgate serve --model ../shared/models/aidreams-260k --port 8000
    PREFIXGATE_BASE_URL=http://127.0.0.1:8000/v1 python examples/anthropic_client.py

Shows: a message with a cached system prompt (``cache_control``), written to the cache by the
first call and read from it by the second; ``count_tokens``; a stream. The system prompt and
``max_tokens`` fit aidreams-260k's 128-token context (the prompt is 72 tokens there); a longer
prompt is answered 400 with the context named.
"""

from __future__ import annotations

import os

import anthropic
from _unreachable import exit_if_unreachable

# The Messages API lives at the server's root (the client adds /v1/messages).
BASE_URL = os.environ.get("PREFIXGATE_BASE_URL", "http://127.0.0.1:8000/v1").removesuffix("/v1")
# A gateway started without --api-key accepts any key; the client insists on having one.
API_KEY = os.environ.get("PREFIXGATE_API_KEY", "unused")

SYSTEM = [
    {
        "type": "text",
        "text": "You are a storyteller for children. You tell short, kind stories about "
        "animals and the forest, in simple words.",
        "cache_control": {"type": "ephemeral"},  # pinned for 5 minutes, read by the next call
    }
]
MESSAGES = [{"role": "user", "content": "Hello"}]


def main() -> None:
    client = anthropic.Anthropic(base_url=BASE_URL, api_key=API_KEY, max_retries=2)
    model = client.models.list().data[0].id
    print(f"model: {model}")
    count = client.messages.count_tokens(model=model, system=SYSTEM, messages=MESSAGES)
    print(f"prompt: {count.input_tokens} tokens")
    for call in ("first", "second"):
        msg = client.messages.create(
            model=model,
            max_tokens=32,
            system=SYSTEM,
            messages=MESSAGES,
            extra_body={"temperature": 0},  # newer clients dropped the typed argument
        )
        u = msg.usage
        print(
            f"{call} call: {u.cache_creation_input_tokens} written, "
            f"{u.cache_read_input_tokens} read, {u.input_tokens} uncached, "
            f"stop {msg.stop_reason}"
        )
    print("stream: ", end="", flush=True)
    with client.messages.stream(
        model=model, max_tokens=32, system=SYSTEM, messages=MESSAGES
    ) as stream:
        for text in stream.text_stream:
            print(text, end="", flush=True)
    print()


if __name__ == "__main__":
    with exit_if_unreachable(anthropic.APIConnectionError, BASE_URL):
        main()
