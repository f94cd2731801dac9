"""Quickstart: the prefixgate SDK against a running gateway.

Start a server first (the built-in small model, or any Hugging Face directory):

    prefixgate serve --port 8000                     # or: --model ../shared/models/aidreams-260k
    PREFIXGATE_BASE_URL=http://127.0.0.1:8000/v1 python examples/quickstart.py

Shows: listing models, a chat completion with its usage (cached prompt tokens), streaming
deltas as they are produced, and a batch run under the client's concurrency limit.
"""

from __future__ import annotations

import asyncio
import os

from _unreachable import exit_if_unreachable
from prefixgate.sdk import APIConnectionError, AsyncClient, AuthenticationError

BASE_URL = os.environ.get("PREFIXGATE_BASE_URL", "http://127.0.0.1:8000/v1")
SYSTEM = "You are a concise assistant. Answer in one sentence."


async def main() -> None:
    # At most 8 requests in flight; 429s and connection errors retried with backoff.
    async with AsyncClient(BASE_URL, max_concurrency=8, max_retries=3) as client:
        models = await client.models.list()
        model = models.data[0].id
        print(f"model: {model}")

        # 1. One chat completion.
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "I sense the nodes"},
        ]
        r = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=24, temperature=0
        )
        print(f"reply: {r.choices[0].message.content!r}")
        print(
            f"usage: {r.usage.prompt_tokens} prompt tokens, {r.usage.completion_tokens} completion tokens"
        )

        # 2. The same system prompt again: its KV blocks come from the server's prefix cache.
        r2 = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=24, temperature=0
        )
        cached = (
            r2.usage.prompt_tokens_details.cached_tokens if r2.usage.prompt_tokens_details else 0
        )
        print(f"second call: {cached} of {r2.usage.prompt_tokens} prompt tokens were cached")

        # 3. Streaming: print each delta as soon as it arrives.
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=24, temperature=0, stream=True
        )
        print("stream: ", end="", flush=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
        print()

        # 4. A batch: results in input order, one failure does not cancel the others.
        tasks = ["The sky", "A quiet room", "Numbers dance", "In the garden"]
        results = await client.chat.completions.batch(
            [
                {
                    "model": model,
                    "messages": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": t},
                    ],
                    "max_tokens": 12,
                    "temperature": 0,
                }
                for t in tasks
            ]
        )
        for task, res in zip(tasks, results, strict=True):
            text = (
                res.choices[0].message.content
                if not isinstance(res, Exception)
                else f"error: {res}"
            )
            print(f"batch {task!r}: {text!r}")


if __name__ == "__main__":
    with exit_if_unreachable(APIConnectionError, BASE_URL, unauthorized=AuthenticationError):
        asyncio.run(main())
