"""prefixgate's prefix API: register a long system prompt once, then send only the user turns.

    prefixgate serve --port 8000
    PREFIXGATE_BASE_URL=http://127.0.0.1:8000/v1 python examples/prefix_api.py

``POST /v1/prefixes`` renders the leading messages with the chat template and pins their KV
blocks for ``ttl_seconds``; a chat request with ``prefix_id`` carries only the new messages and
is served as the whole conversation. ``PrefixSession`` wraps the pattern (and falls back to
full messages against servers without the route).
"""

from __future__ import annotations

import asyncio
import os

from _unreachable import exit_if_unreachable
from prefixgate.sdk import APIConnectionError, AsyncClient, AuthenticationError

BASE_URL = os.environ.get("PREFIXGATE_BASE_URL", "http://127.0.0.1:8000/v1")
SYSTEM = "You are a linux terminal. Reply only with the terminal output, nothing else."


async def main() -> None:
    async with AsyncClient(BASE_URL, max_concurrency=4) as client:
        model = (await client.models.list()).data[0].id
        system = [{"role": "system", "content": SYSTEM}]

        # 1. Register the prefix explicitly.
        prefix = await client.prefixes.create(model=model, messages=system, ttl_seconds=300)
        print(f"prefix {prefix.id}: {prefix.prompt_tokens} tokens pinned until {prefix.expires_at}")

        user = [{"role": "user", "content": "pwd"}]
        via_prefix = await client.chat.completions.create(
            model=model, messages=user, prefix_id=prefix.id, max_tokens=16, temperature=0
        )
        full = await client.chat.completions.create(
            model=model, messages=system + user, max_tokens=16, temperature=0
        )
        details = via_prefix.usage.prompt_tokens_details
        print(f"with prefix_id: {via_prefix.choices[0].message.content!r}")
        print(
            f"  {details.cached_tokens if details else 0} of {via_prefix.usage.prompt_tokens} prompt tokens cached"
        )
        print(
            f"same text as sending the full messages: {via_prefix.choices[0].message.content == full.choices[0].message.content}"
        )

        info = await client.prefixes.get(prefix.id)
        print(f"get: {info.id} expires at {info.expires_at}")
        await client.prefixes.delete(prefix.id)
        print("deleted")

        # 2. The helper: registers on first use, sends only user turns, deletes on exit.
        async with client.prefixes.session(SYSTEM, model=model, ttl_seconds=120) as session:
            for cmd in ("ls", "whoami"):
                r = await session.create(cmd, max_tokens=12, temperature=0)
                print(f"session {cmd!r}: {r.choices[0].message.content!r}")


if __name__ == "__main__":
    with exit_if_unreachable(APIConnectionError, BASE_URL, unauthorized=AuthenticationError):
        asyncio.run(main())
