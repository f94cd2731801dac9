"""The pooling runner: a model served for embeddings (``EngineConfig.runner="pooling"``).

Each input is one prefill-only forward of the decoder (no sampling, no decode); its final
hidden states (after the last RMSNorm, ``[T, H]``) are pooled into one vector: the last
token's (``pooling_type="last"``, as Qwen3-Embedding and other Llama-family embedding models
are trained) or the mean over the tokens (``"mean"``), then L2-normalized — the defaults of
vLLM's ``--runner pooling`` for these models (vLLM docs, "Pooling models").

Inputs are packed into flat batches of at most ``max_num_batched_tokens`` tokens and run over
a scratch paged KV cache (the same model forward and attention metadata as generation, each
input on its own blocks); nothing is cached between calls, so embeddings never share state
across callers. ``PoolingEngine`` offers the gateway's ``EngineClient`` surface: generation
calls raise ``ValueError`` (the gateway answers 400), ``embed`` does the work.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.errors import EngineDeadError
from prefixgate.engine.kv_cache import KVCacheSpec, allocate_kv_caches
from prefixgate.engine.model_runner import ModelRunner
from prefixgate.engine.models.config import ModelConfig
from prefixgate.engine.models.loader import load_model
from prefixgate.engine.outputs import StepOutput
from prefixgate.engine.protocol import EngineRequest, PinRequest
from prefixgate.engine.threads import apply_threads
from prefixgate.engine.tokenizer import Tokenizer

_NOT_GENERATIVE = (
    "this model is served as an embedding model (--runner pooling): use /v1/embeddings; "
    "start the server without --runner pooling to generate text"
)


def pool(hidden: torch.Tensor, lengths: Sequence[int], pooling_type: str) -> torch.Tensor:
    """Pool a flat batch of hidden states into one L2-normalized vector per sequence.

    Args:
        hidden: ``[T, H]`` final hidden states of the sequences laid end to end.
        lengths: tokens of each sequence (sum == T).
        pooling_type: ``"last"`` (the last token's state) or ``"mean"`` (mean over tokens).

    Returns:
        ``[B, H]`` float32, each row of unit L2 norm.
    """
    rows = []
    start = 0
    for n in lengths:
        seq = hidden[start : start + n].float()
        rows.append(seq[-1] if pooling_type == "last" else seq.mean(dim=0))
        start += n
    out = torch.stack(rows)
    return torch.nn.functional.normalize(out, p=2.0, dim=-1)


class PoolingEngine:
    """Embeddings of token-id inputs with a Llama-family model (see the module docstring).

    Args:
        config: the engine configuration; ``config.runner`` must be ``"pooling"``;
            ``config.pooling_type`` chooses last-token or mean pooling;
            ``config.max_num_batched_tokens`` bounds a forward's tokens (an input longer than
            it runs alone).

    Raises:
        ValueError: ``config.runner`` is not ``"pooling"``, or a bad configuration.
    """

    def __init__(self, config: EngineConfig) -> None:
        if config.runner != "pooling":
            raise ValueError(f"PoolingEngine needs runner='pooling', got {config.runner!r}")
        self._config = config
        apply_threads(config.threads)  # once, before the model is built
        mc = ModelConfig.from_engine_config(config)
        self.model_config = mc
        self._tokenizer = (
            Tokenizer.builtin()
            if mc.model_path is None
            else Tokenizer.from_pretrained(mc.model_path)
        )
        self._max_model_len = int(mc.max_model_len)
        self.device = torch.device(mc.device)
        self.model = load_model(mc, config)
        bs = config.block_size
        budget = max(config.max_num_batched_tokens, self._max_model_len)
        # every input rounds up to whole blocks: one spare block per input of the batch
        num_blocks = -(-budget // bs) + config.max_num_seqs + 1
        spec = KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, bs, mc.dtype)
        self._kv_caches = allocate_kv_caches(spec, num_blocks, self.device)
        self._runner = ModelRunner(self.model, self._kv_caches, None, bs, self.device)
        self._lock = threading.Lock()
        self._dead = False
        self._counts = {"embedding_requests": 0, "embedding_tokens": 0}

    # --- EngineClient surface -------------------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    async def generate(self, request: EngineRequest) -> AsyncIterator[StepOutput]:
        """Not available on a pooling runner (``EngineClient.generate``'s signature).

        Raises:
            ValueError: always (the gateway answers 400).
        """
        raise ValueError(_NOT_GENERATIVE)
        yield  # pragma: no cover - makes this an async generator

    async def abort(self, request_id: str) -> None:
        raise ValueError(f"request {request_id!r} is not in flight")

    async def pin_prefix(self, pin: PinRequest) -> Any:
        """Not available on a pooling runner (``EngineClient.pin_prefix``'s signature).

        Raises:
            ValueError: always, whatever the pin (the gateway answers 400).
        """
        raise ValueError(_NOT_GENERATIVE)

    def get_pin(self, pin_id: str) -> Any:
        raise KeyError(pin_id)

    def unpin_prefix(self, pin_id: str) -> None:
        raise KeyError(pin_id)

    def predict_ttft(self, num_prompt_tokens: int, num_cached_tokens: int = 0) -> float | None:
        """``None``: a pooling engine generates no tokens (the gateway admits without a
        prediction)."""
        return None

    def stats(self) -> dict[str, Any]:
        """Counters: embedding inputs and tokens served, and the generation keys at zero (so
        ``/metrics`` and the engine line read one shape)."""
        return {
            "num_running": 0,
            "num_waiting": 0,
            "kv_blocks_total": int(self._kv_caches[0][0].shape[0]) if self._kv_caches else 0,
            "kv_blocks_used": 0,
            "kv_blocks_free": int(self._kv_caches[0][0].shape[0]) if self._kv_caches else 0,
            "prompt_tokens_prefilled": self._counts["embedding_tokens"],
            "tokens_decoded": 0,
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
            "prefix_cache_hit_rate": 0.0,
            **self._counts,
        }

    async def shutdown(self) -> None:
        self._dead = True

    # --- embeddings ---------------------------------------------------------------------
    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        """Embeddings of ``inputs`` (token-id lists), in order (thread-safe; blocks).

        Returns:
            one list of ``hidden_size`` floats per input, L2 norm 1.

        Raises:
            ValueError: an empty input, an id outside the vocabulary, or an input of
                ``max_model_len`` tokens or more.
            EngineDeadError: after ``shutdown()``.
        """
        vocab = self.model_config.vocab_size
        for i, ids in enumerate(inputs):
            if not ids:
                raise ValueError(f"input {i} is empty")
            if len(ids) > self._max_model_len:
                raise ValueError(
                    f"input {i} has {len(ids)} tokens; this model's context is "
                    f"{self._max_model_len} tokens"
                )
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"input {i}: token id {bad} is outside [0, {vocab})")
        out: list[list[float]] = []
        with self._lock:
            if self._dead:
                raise EngineDeadError("the engine is shut down")
            for batch in self._batches(inputs):
                out.extend(self._run(batch).tolist())
            self._counts["embedding_requests"] += len(inputs)
            self._counts["embedding_tokens"] += sum(len(x) for x in inputs)
        return out

    async def embed_async(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        """``embed`` in a worker thread (the event loop keeps serving)."""
        return await asyncio.to_thread(self.embed, inputs)

    def _batches(self, inputs: Sequence[Sequence[int]]) -> list[list[Sequence[int]]]:
        budget = self._config.max_num_batched_tokens
        batches: list[list[Sequence[int]]] = []
        cur: list[Sequence[int]] = []
        used = 0
        for ids in inputs:
            if cur and (used + len(ids) > budget or len(cur) >= self._config.max_num_seqs):
                batches.append(cur)
                cur, used = [], 0
            cur.append(ids)
            used += len(ids)
        if cur:
            batches.append(cur)
        return batches

    @torch.inference_mode()
    def _run(self, batch: list[Sequence[int]]) -> torch.Tensor:
        bs = self._config.block_size
        scheduled = []
        next_block = 0
        for ids in batch:
            nb = -(-len(ids) // bs)
            block_ids = list(range(next_block, next_block + nb))
            next_block += nb
            req = SimpleNamespace(num_computed_tokens=0, all_token_ids=list(ids))
            scheduled.append(
                SimpleNamespace(request=req, num_new_tokens=len(ids), block_ids=block_ids)
            )
        inp = self._runner.prepare(scheduled)
        hidden = self.model(inp.input_ids, inp.positions, self._kv_caches, inp.meta)
        return pool(hidden, [len(ids) for ids in batch], self._config.pooling_type)
