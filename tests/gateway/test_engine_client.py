"""The gateway <-> engine seam: the engine and the tests' fake both implement ``EngineClient``.

mypy checks this file (``.ci/typecheck``): the functions below only type-check when
``AsyncEngine`` and ``FakeEngine`` structurally satisfy the protocol. The tests check the same
at run time (``runtime_checkable``: the members exist).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefixgate.engine.protocol import EngineClient, PinHandle, TokenizerLike
from support.fake_engine import FakeEngine

if TYPE_CHECKING:
    from prefixgate.engine.async_engine import AsyncEngine
    from prefixgate.engine.kv_cache_manager import PrefixPin
    from prefixgate.engine.tokenizer import Tokenizer


def _engine_is_a_client(engine: AsyncEngine) -> EngineClient:
    return engine  # mypy: AsyncEngine implements EngineClient


def _tokenizer_is_like(tokenizer: Tokenizer) -> TokenizerLike:
    return tokenizer  # mypy: the engine's Tokenizer implements TokenizerLike


def _pin_is_a_handle(pin: PrefixPin) -> PinHandle:
    return pin  # mypy: the engine's PrefixPin is a PinHandle


def _fake_is_a_client(engine: FakeEngine) -> EngineClient:
    return engine  # mypy: the tests' fake implements EngineClient too


def test_fake_engine_implements_engine_client():
    engine = FakeEngine()
    assert isinstance(engine, EngineClient)
    assert isinstance(engine.tokenizer, TokenizerLike)


def test_async_engine_implements_engine_client():
    from prefixgate.engine.async_engine import AsyncEngine

    engine = AsyncEngine(num_kv_blocks=16)
    try:
        assert isinstance(engine, EngineClient)
        assert isinstance(engine.tokenizer, TokenizerLike)
    finally:
        import asyncio

        asyncio.run(engine.shutdown())
