"""A prefix create cancelled (its client gone, ``handler_cancellation``) while it talks to the
shared state leaves nothing behind: no engine pin, no entry, no count against the key's
``max_prefixes`` in the shared state, no published record."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prefixgate.gateway.prefixes import PrefixQuota, PrefixRegistry
from prefixgate.gateway.state_backend import LocalState
from support.fake_engine import FakeEngine


class _SharedStub(LocalState):
    """Shared prefixes in a dict; ``block`` names the call that never answers."""

    shares_prefixes = True  # type: ignore[assignment]

    def __init__(self, block: str) -> None:
        self.block = block
        self.reached = asyncio.Event()
        self.counted: set[str] = set()
        self.records: dict[str, Any] = {}

    async def _maybe_block(self, name: str) -> None:
        if name == self.block:
            self.reached.set()
            await asyncio.Event().wait()

    async def reserve_prefix(self, owner, prefix_id, max_prefixes, ttl_s):  # type: ignore[override]
        self.counted.add(prefix_id)  # counted there, the answer lost
        await self._maybe_block("reserve")
        return 0.0

    async def release_prefix(self, owner, prefix_id):  # type: ignore[override]
        self.counted.discard(prefix_id)

    async def put_prefix(self, prefix_id, record, ttl_s):  # type: ignore[override]
        self.records[prefix_id] = record  # written, the answer lost
        await self._maybe_block("put")

    async def get_prefix(self, prefix_id):  # type: ignore[override]
        return self.records.get(prefix_id)

    async def delete_prefix(self, prefix_id):  # type: ignore[override]
        self.records.pop(prefix_id, None)


@pytest.mark.parametrize("block", ["reserve", "put"])
def test_create_cancelled_while_talking_to_the_shared_state_leaves_nothing(block):
    async def main() -> None:
        engine = FakeEngine()
        shared = _SharedStub(block)
        registry = PrefixRegistry(engine, shared=shared)
        task = asyncio.ensure_future(
            registry.create(
                [{"role": "system", "content": "x" * 64}],
                list(range(1, 70)),
                60.0,
                "salt",
                owner="key:k",
                quota=PrefixQuota(max_prefixes=2),
            )
        )
        await shared.reached.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.pinned_blocks == 0
        assert len(registry) == 0
        assert shared.counted == set()
        assert shared.records == {}

    asyncio.run(main())
