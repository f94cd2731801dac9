"""The gateway as a reverse proxy in front of another OpenAI-compatible server.

    prefixgate serve --port 8000                       # any OpenAI-compatible server will do
    PREFIXGATE_UPSTREAM_URL=http://127.0.0.1:8000/v1 python examples/proxy.py

Starts a gateway in upstream mode on a free loopback port (the in-process equivalent of
``prefixgate serve --upstream URL``), then sends the same requests directly and through the
proxy: greedy outputs are identical and streams pass through chunk by chunk. With several
upstreams the gateway routes by prefix affinity (the same system prompt goes to the same
upstream, where its KV is cached).
"""

from __future__ import annotations

import asyncio
import os

from _unreachable import exit_if_unreachable
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import start_server
from prefixgate.sdk import APIConnectionError, AsyncClient, AuthenticationError

UPSTREAM = os.environ.get("PREFIXGATE_UPSTREAM_URL") or os.environ.get(
    "PREFIXGATE_BASE_URL", "http://127.0.0.1:8000/v1"
)
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant that answers briefly."},
    {"role": "user", "content": "I sense the nodes"},
]


async def ask(base_url: str) -> tuple[str, str]:
    """(non-streamed text, streamed text) of the same greedy request against ``base_url``."""
    async with AsyncClient(base_url, max_concurrency=4) as client:
        model = (await client.models.list()).data[0].id
        r = await client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=16, temperature=0
        )
        parts = []
        stream = await client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=16, temperature=0, stream=True
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        return r.choices[0].message.content, "".join(parts)


async def main() -> None:
    proxy = await start_server(create_proxy_app([UPSTREAM]), host="127.0.0.1", port=0)
    try:
        print(f"proxy {proxy.url} -> upstream {UPSTREAM}")
        direct = await ask(UPSTREAM)
        via = await ask(proxy.url + "/v1")
        print(f"direct:    {direct[0]!r}")
        print(f"via proxy: {via[0]!r}")
        print(f"identical: {direct == via} (streamed through the proxy: {via[1]!r})")
    finally:
        await proxy.stop()


if __name__ == "__main__":
    with exit_if_unreachable(
        APIConnectionError, UPSTREAM, "PREFIXGATE_UPSTREAM_URL", unauthorized=AuthenticationError
    ):
        asyncio.run(main())
