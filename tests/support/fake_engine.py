"""A fake AsyncEngine with the docs/architecture.md contract (gateway <-> engine), for tests.

Byte-level tokenizer (id = byte + 3; 1 = <s>, 2 = </s>), deterministic "generation" (letters
derived from the prompt), a per-token delay, ``max_num_seqs`` running at a time (the rest
wait), a block-aligned prefix cache per salt (for ``num_cached_tokens``), pins with a cap,
and block accounting so tests can check that aborted requests free their blocks.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

from prefixgate.engine.config import EngineConfig
from prefixgate.engine.errors import EngineDeadError, PinLimitError
from prefixgate.engine.outputs import Logprob, StepOutput, TokenLogprobs
from prefixgate.engine.protocol import EngineRequest, PinRequest
from prefixgate.engine.sampling_params import SamplingParams

__all__ = ["IDLE_STATS", "EngineDeadError", "FakeEngine", "FakeTokenizer", "PinLimitError"]

# An engine's ``stats()`` after some work, now idle (tokens, blocks; the hit rate a fraction).
IDLE_STATS = {
    "prompt_tokens_prefilled": 100,
    "tokens_decoded": 50,
    "num_running": 0,
    "num_waiting": 0,
    "prefix_cache_queries": 200,
    "prefix_cache_hits": 100,
    "prefix_cache_hit_rate": 0.5,
    "kv_blocks_total": 64,
    "kv_blocks_used": 0,
}


class FakeTokenizer:
    bos_token_id = 1
    eos_token_ids = {2}
    vocab_size = 259
    encoded_bytes = 0  # bytes of text tokenized so far (tests of refusing before working)

    def min_num_tokens(self, text: str) -> int:
        return len(text.encode())  # one token per byte

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        FakeTokenizer.encoded_bytes += len(text.encode())
        ids: list[int] = []
        if text.startswith("<s>"):
            ids.append(1)
            text = text[3:]
        elif add_special_tokens:
            ids.append(1)
        ids.extend(b + 3 for b in text.encode())
        return ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i - 3 for i in ids if i >= 3)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self.decode([token_id]).encode()  # the token's text as UTF-8 (U+FFFD kept)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if any(m["role"] == "tool" for m in messages):
            raise ValueError("this template has no tool role")
        return "<s>" + "\n\n".join(m["content"] for m in messages)

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        # Only the leading "<s>" is special here: content can never produce one.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), False)


@dataclass
class _Pin:
    id: str
    num_tokens: int
    expires_at: float
    blocks: int


class FakeEngine:
    """Implements ``EngineClient`` (``prefixgate.engine.protocol``), raising the engine's own
    error classes (``PinLimitError``, ``EngineDeadError`` after ``shutdown``)."""

    def __init__(
        self,
        max_model_len: int = 128,
        token_delay_s: float = 0.002,
        max_num_seqs: int = 8,
        num_blocks: int = 64,
        block_size: int = 16,
        max_pinned_fraction: float = 0.5,
        scheduling_policy: str = "fcfs",
    ) -> None:
        self.tokenizer = FakeTokenizer()
        self.config = EngineConfig(
            model=None,
            block_size=block_size,
            scheduling_policy=scheduling_policy,  # type: ignore[arg-type]
        )
        self.max_model_len = max_model_len
        self.token_delay_s = token_delay_s
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_pinned_fraction = max_pinned_fraction
        self._slots = asyncio.Semaphore(max_num_seqs) if max_num_seqs else None
        self._max_num_seqs = max_num_seqs
        self._running: dict[str, int] = {}  # request id -> blocks held
        self._waiting: set[str] = set()
        self._aborted: set[str] = set()
        self._cache: dict[str | None, list[list[int]]] = {}
        self._pins: dict[str, _Pin] = {}
        self.tenants_seen: list[tuple[str | None, int]] = []  # (tenant, priority) per generate
        self.pin_tenants_seen: list[str | None] = []  # tenant per pin_prefix
        self.rates: dict[str, float | None] = {}  # stats() overrides: measured rates
        self.predicted_ttft: float | None = None  # what predict_ttft answers (tests set it)
        self.tenant_rows: dict[str, dict] = {}  # stats()["tenants"], set by tests
        self.generated = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache / found there
        self.prefix_hits = 0
        self.requests_seen: list[tuple[str, list[int], SamplingParams, str | None]] = []
        self.shutdown_called = False

    # --- test aids ----------------------------------------------------------------------
    def fail_after(self, num_outputs: int) -> None:
        """From now on every ``generate`` raises ``RuntimeError("boom")`` after yielding
        ``num_outputs`` outputs (an engine failure mid-stream); the request's blocks are freed
        then, as on any failure, not at garbage collection."""
        real = self.generate

        async def failing(request: EngineRequest) -> AsyncIterator[StepOutput]:
            inner = cast(AsyncGenerator[StepOutput, None], real(request))
            try:
                n = 0
                async for out in inner:
                    yield out
                    n += 1
                    if n == num_outputs:
                        raise RuntimeError("boom")
            finally:
                await inner.aclose()

        self.generate = failing  # type: ignore[method-assign]

    def abort_after(self, num_outputs: int) -> None:
        """From now on the engine aborts every request itself after ``num_outputs`` outputs:
        its next output is the last, ``finish_reason="abort"`` (as ``abort`` ends one; vLLM's
        engine-side abort)."""
        real = self.generate

        async def aborting(request: EngineRequest) -> AsyncIterator[StepOutput]:
            inner = cast(AsyncGenerator[StepOutput, None], real(request))
            try:
                n = 0
                async for out in inner:
                    yield out
                    n += 1
                    if n == num_outputs and not out.finished:
                        await self.abort(request.request_id)
            finally:
                await inner.aclose()

        self.generate = aborting  # type: ignore[method-assign]

    # --- the contract -----------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncIterator[StepOutput]:
        prompt, params, request_id = request.prompt, request.sampling_params, request.request_id
        cache_salt = request.cache_salt
        self.tenants_seen.append((request.tenant, request.priority))
        if self.shutdown_called:
            raise EngineDeadError("the engine is shut down")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) >= self.max_model_len:
            raise ValueError("prompt longer than max_model_len")
        if request_id in self._running or request_id in self._waiting:
            raise ValueError(f"duplicate request id {request_id}")
        self.requests_seen.append((request_id, ids, params, cache_salt))
        max_tokens = min(params.max_tokens or 10**9, self.max_model_len - len(ids))
        cached = self._lookup(ids, cache_salt)
        self.prefix_queries += len(ids)
        self.prefix_hits += cached
        self._waiting.add(request_id)
        want_logprobs = params.logprobs is not None
        first = True

        def output(
            ids_: list[int],
            text: str,
            lps: list[TokenLogprobs] | None,
            finish: str | None = None,
            stop_reason: str | None = None,
        ) -> StepOutput:
            # a fresh object per step holding only what is new (the engine's contract)
            nonlocal first
            metrics = {"arrival": time.monotonic()} if (first and ids_) or finish else {}
            first = first and not ids_
            return StepOutput(
                request_id,
                ids_,
                text,
                lps,
                finish,  # type: ignore[arg-type]
                stop_reason,
                num_cached_tokens=cached,
                metrics=metrics,
            )

        acquired = False
        try:
            if self._slots is not None:
                await self._slots.acquire()
                acquired = True
            self._waiting.discard(request_id)
            self._running[request_id] = math.ceil(len(ids) / self.block_size)
            seed = params.seed or 0
            base = sum(ids) + seed * 7
            text = ""  # every character decoded so far
            sent = 0  # characters of it already sent (the rest may start a stop string)
            for i in range(max_tokens):
                await asyncio.sleep(self.token_delay_s)
                if request_id in self._aborted:
                    yield output([], "", [] if want_logprobs else None, "abort")
                    return
                tok = 3 + ord("a") + (base + i) % 26
                self.generated += 1
                self._running[request_id] = math.ceil((len(ids) + i + 1) / self.block_size)
                piece = self.tokenizer.decode([tok])
                text += piece
                lps = None
                if want_logprobs:
                    alts = [
                        Logprob(tok + k, -0.1 * (k + 1), chr(tok + k - 3))
                        for k in range(params.logprobs or 0)
                    ]
                    lps = [TokenLogprobs(Logprob(tok, -0.1, piece), alts)]
                stop = next((s for s in params.stop if s in text[max(0, sent - 64) :]), None)
                if stop is not None:
                    cut = text.index(stop, max(0, sent - 64))
                    res = output([tok], text[sent:cut], lps, "stop", stop)
                elif i + 1 == max_tokens:
                    res = output([tok], text[sent:], lps, "length")
                else:
                    held = _stop_prefix_len(text, params.stop)
                    res = output([tok], text[sent : len(text) - held], lps)
                    sent = len(text) - held
                yield res
                if res.finished:
                    self._store(ids, cache_salt)
                    return
        finally:
            self._waiting.discard(request_id)
            self._running.pop(request_id, None)
            self._aborted.discard(request_id)
            if acquired and self._slots is not None:
                self._slots.release()

    async def abort(self, request_id: str) -> None:
        if request_id not in self._running and request_id not in self._waiting:
            raise ValueError(f"unknown request id {request_id}")
        self._aborted.add(request_id)

    async def pin_prefix(self, pin: PinRequest) -> _Pin:
        if self.shutdown_called:
            raise EngineDeadError("the engine is shut down")
        token_ids = list(pin.token_ids)
        self.pin_tenants_seen.append(pin.tenant)
        blocks = len(token_ids) // self.block_size
        self._expire_pins()
        if self.pinned_blocks + blocks > self.max_pinned_fraction * self.num_blocks:
            raise PinLimitError(f"pinning {blocks} blocks would exceed the pinned cap")
        self._store(token_ids, pin.cache_salt)
        held = _Pin(
            f"pin-{len(self._pins)}-{time.monotonic_ns()}",
            len(token_ids),
            time.monotonic() + pin.ttl_s,
            blocks,
        )
        self._pins[held.id] = held
        return held

    def get_pin(self, pin_id: str) -> _Pin:
        """The live pin (KeyError once released or past its TTL: the engine owns the TTL)."""
        self._expire_pins()
        return self._pins[pin_id]

    def unpin_prefix(self, pin_id: str) -> None:
        if pin_id not in self._pins:
            raise KeyError(pin_id)
        del self._pins[pin_id]

    def _expire_pins(self) -> None:
        now = time.monotonic()
        for pin_id in [p.id for p in self._pins.values() if p.expires_at <= now]:
            del self._pins[pin_id]

    @property
    def pinned_blocks(self) -> int:
        self._expire_pins()
        return sum(p.blocks for p in self._pins.values())

    def predict_ttft(self, num_prompt_tokens: int, num_cached_tokens: int = 0) -> float | None:
        if num_prompt_tokens < 1:
            raise ValueError("num_prompt_tokens must be >= 1")
        return self.predicted_ttft

    def stats(self) -> dict:
        used = sum(self._running.values()) + self.pinned_blocks
        return {
            "num_running": len(self._running),
            "num_waiting": len(self._waiting),
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_used": used,
            "kv_blocks_free": self.num_blocks - used,
            "kv_blocks_cached_free": 0,
            "prompt_tokens_prefilled": 0,
            "tokens_decoded": self.generated,
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "prefix_cache_hit_rate": self.prefix_hits / self.prefix_queries
            if self.prefix_queries
            else 0.0,
            "prefix_cache_evictions": 0,
            "pinned_blocks": self.pinned_blocks,
            "num_preemptions": 0,
            "num_displacements": 0,
            "queued_prefill_tokens": 0,
            "running_decodes": len(self._running),
            "prefill_tokens_per_s": None,
            "decode_tokens_per_s": None,
            "finished_per_s": None,
            "tenants": dict(self.tenant_rows),
            **self.rates,
        }

    def check_invariants(self) -> None:
        s = self.stats()
        assert s["kv_blocks_used"] + s["kv_blocks_free"] == s["kv_blocks_total"]

    async def shutdown(self) -> None:
        self.shutdown_called = True

    # --- helpers ------------------------------------------------------------------------
    def _lookup(self, ids: list[int], salt: str | None) -> int:
        best = 0
        for seen in self._cache.get(salt, []):
            n = 0
            for a, b in zip(seen, ids[:-1], strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n // self.block_size * self.block_size)
        return best

    def _store(self, ids: list[int], salt: str | None) -> None:
        self._cache.setdefault(salt, []).append(list(ids))


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest end of ``text`` that a stop string starts with (held back)."""
    for k in range(min(max((len(s) for s in stops), default=1) - 1, len(text)), 0, -1):
        if any(s.startswith(text[-k:]) for s in stops):
            return k
    return 0


def assert_idle_and_whole(srv: Any, engine) -> None:
    """The fake ``engine`` served by ``srv`` ends idle (nothing running or waiting: a disconnect
    or error the gateway failed to abort would stay) with its invariants held and its pool
    whole (no block used but those live prefix pins hold)."""
    stats = wait_idle(srv, engine)
    srv.call(_check(engine))
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
    assert stats["kv_blocks_used"] == stats["pinned_blocks"], stats


def wait_idle(srv: Any, engine, timeout: float = 5.0) -> dict:
    """Poll until the engine has nothing running or waiting; returns its stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = srv.call(_stats(engine))
        if (stats["num_running"] == 0 and stats["num_waiting"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def _check(engine):
    async def check():
        engine.check_invariants()

    return check


def _stats(engine):
    async def get():
        return engine.stats()

    return get
