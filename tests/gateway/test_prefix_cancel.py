"""A prefix create cancelled (its client gone, ``handler_cancellation``) while it talks to the
shared state leaves nothing behind, in local and in upstream mode: no engine pin, no entry,
no count against the key's ``max_prefixes`` in the shared state, no published record; and
upstream mode's bounds hold for creates that pass them while another awaits."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.local.prefixes import PrefixQuota, PrefixRegistry
from prefixgate.gateway.proxy.prefixes import ProxyPrefixRegistry
from prefixgate.gateway.proxy.upstream import UpstreamRouter
from prefixgate.gateway.tenancy.shared_state import LocalState
from support.fake_engine import FakeEngine
from support.stub_upstream import StubServer


class _SharedStub(LocalState):
    """Shared prefixes in a dict; ``block`` names the call that never answers."""

    shares_prefixes = True  # type: ignore[assignment]

    def __init__(self, block: str) -> None:
        self.block = block
        self.reached = asyncio.Event()
        self.counted: set[str] = set()
        self.records: dict[str, Any] = {}

    async def _maybe_block(self, name: str) -> None:
        await asyncio.sleep(0)  # every call awaits, as a round trip to Redis does
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


@pytest.fixture
def stub() -> Any:
    server = StubServer(name="s").start()
    yield server
    server.stop()


def _proxy_run(stub: StubServer, test: Any) -> None:
    async def main() -> None:
        router = UpstreamRouter([stub.base_url], health_interval_s=60.0)
        await router.start()
        try:
            await test(router)
        finally:
            await router.close()

    asyncio.run(main())


@pytest.mark.parametrize("block", ["reserve", "put"])
def test_proxy_create_cancelled_while_talking_to_the_shared_state_leaves_nothing(stub, block):
    async def test(router: UpstreamRouter) -> None:
        shared = _SharedStub(block)
        registry = ProxyPrefixRegistry(router, shared)
        task = asyncio.ensure_future(
            registry.create(
                "s",
                [{"role": "system", "content": "x" * 64}],
                60.0,
                "salt",
                "salt",
                lambda up: {},
                owner="key:k",
                key_max_prefixes=2,
            )
        )
        await shared.reached.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(registry) == 0 and registry._pending == {}
        assert shared.counted == set()
        assert shared.records == {}

    _proxy_run(stub, test)


def test_proxy_max_prefixes_holds_for_creates_awaiting_their_reservation(stub):
    async def test(router: UpstreamRouter) -> None:
        shared = _SharedStub("none")
        registry = ProxyPrefixRegistry(router, shared, max_prefixes=1)
        results = await asyncio.gather(
            *(
                registry.create(
                    "s",
                    [{"role": "system", "content": f"prefix {i} " * 8}],
                    60.0,
                    f"salt{i}",
                    f"salt{i}",
                    lambda up: {},
                    owner=f"key:{i}",
                    key_max_prefixes=5,
                )
                for i in range(3)
            ),
            return_exceptions=True,
        )
        refused = [r for r in results if isinstance(r, APIError)]
        assert len(registry) == 1 and len(refused) == 2
        assert all(r.status == 429 and r.code == "prefix_limit_exceeded" for r in refused)

    _proxy_run(stub, test)
