"""Model runner: flat batch in, one sampled token per finishing sequence out.

Each step the scheduler hands over the scheduled requests (decodes first, then prefill chunks)
with their block tables. The runner flattens them into one batch (vLLM v1's layout: all query
tokens of all sequences back to back), builds ``AttentionMetadata``, runs the model once under
``torch.inference_mode``, computes logits only for the rows that sample (the last query token of
each request whose prompt or recompute is complete) and samples them.

Host-side batch building is vectorized with numpy; per-request Python work is a handful of list
operations, so host overhead stays small next to the forward pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from prefixgate.engine.attention_metadata import (
    AttentionMetadata,
    VerifyLayout,
    verify_layout_arrays,
)
from prefixgate.engine.kv_cache import KVCaches
from prefixgate.engine.outputs import TokenLogprobs

if TYPE_CHECKING:
    from prefixgate.engine.models.llama import CausalLM


@dataclass(slots=True)
class ModelInput:
    """The flat batch of one step.

    Attributes:
        input_ids: ``[T]`` int64 query token ids, sequence after sequence.
        positions: ``[T]`` int64 absolute positions of those tokens.
        meta: paged-attention metadata (slot mapping, block tables, ...).
        logits_indices: ``[N + D]`` int64 rows of the hidden states whose logits are computed:
            per sampling request its last query token, and before it one row per draft token
            (speculative decoding: ``1 + k`` rows for a request with ``k`` drafts); D = drafts.
        sample_order: indices into the scheduled list of the N requests that sample, in row order.
        num_drafts: per entry of ``sample_order``, its draft count ``k`` (0 without drafts).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sample_order: list[int]
    num_drafts: list[int] = field(default_factory=list)


@dataclass(slots=True)
class RunnerOutput:
    """What one ``execute`` produced.

    Attributes:
        sampled: request id → sampled token id (requests that sampled this step only); for a
            request that verified drafts, the list of its accepted drafts then the correction
            or bonus token.
        logprobs: request id → ``TokenLogprobs`` (requests that asked for logprobs only).
        forward_s: seconds spent in the model forward + logits (host wall clock).
        prepare_s: seconds spent building the flat batch and its metadata.
        sample_s: seconds spent sampling (and reading the tokens back).
    """

    sampled: dict[str, int | list[int]]
    logprobs: dict[str, TokenLogprobs]
    forward_s: float
    prepare_s: float = 0.0
    sample_s: float = 0.0


class ModelRunner:
    """Owns the model, its paged KV caches and the sampler.

    Args:
        model: ``CausalLM`` following the docs/architecture.md model contract.
        kv_caches: one ``(k, v)`` pair per layer, ``[num_blocks, block_size, kv_heads, head_dim]``.
        sampler: ``Sampler`` with ``sample(logits [B, V] fp32, states) -> list[SampleResult]``
            (its ``LogitsPipeline`` applies each constrained row's grammar mask).
        block_size: tokens per KV block.
        device: where the model and caches live.
        sync_timing: synchronize CUDA around the forward so ``forward_s`` is exact (benchmarks).
        structured_output: the ``StructuredOutputManager`` (kept for callers; the sampler's
            pipeline holds the one that masks).
        cuda_graphs: ``DecodeCudaGraphs`` replaying decode-only forwards, or None (eager).
    """

    def __init__(
        self,
        model: CausalLM,
        kv_caches: KVCaches,
        sampler: Any,
        block_size: int,
        device: torch.device,
        sync_timing: bool = False,
        structured_output: Any | None = None,
        cuda_graphs: Any | None = None,
    ) -> None:
        self.model = model
        self.cuda_graphs = cuda_graphs
        self.structured_output = structured_output
        self.kv_caches = kv_caches
        self.sampler = sampler
        self.block_size = block_size
        self.device = torch.device(device)
        self.sync_timing = sync_timing and self.device.type == "cuda"
        self._pin = self.device.type == "cuda"

    # -- batch building ------------------------------------------------------------------

    def prepare(self, scheduled: list[Any]) -> ModelInput:
        """Flatten scheduled requests (``ScheduledRequest(request, num_new_tokens, block_ids)``,
        single-token queries first, then verify rows with ``spec_token_ids``, then prefill
        chunks) into a ``ModelInput``.

        Query tokens of request r are ``r.all_token_ids[c : c + n - k] + spec_token_ids``
        with ``c = r.num_computed_tokens``, ``n = num_new_tokens`` and ``k`` drafts (0 but for
        speculative decoding); their positions are ``c .. c+n-1`` and their slots
        ``block_ids[p // S] * S + p % S``.
        """
        bs = self.block_size
        num_seqs = len(scheduled)
        q_lens = np.empty(num_seqs, dtype=np.int64)
        starts = np.empty(num_seqs, dtype=np.int64)
        token_ids: list[int] = []
        max_blocks = 1
        sample_order: list[int] = []
        num_drafts: list[int] = []
        for i, s in enumerate(scheduled):
            r = s.request
            n = s.num_new_tokens
            c = r.num_computed_tokens
            q_lens[i] = n
            starts[i] = c
            all_ids = r.all_token_ids
            spec = getattr(s, "spec_token_ids", None)
            if spec:
                n -= len(spec)
                token_ids.extend(all_ids[c : c + n])
                token_ids.extend(spec)
            elif n == 1:
                token_ids.append(all_ids[c])
            else:
                token_ids.extend(all_ids[c : c + n])
            if c + n == len(all_ids):
                sample_order.append(i)
                num_drafts.append(len(spec) if spec else 0)
            nb = len(s.block_ids)
            if nb > max_blocks:
                max_blocks = nb
        num_decodes = 0
        while num_decodes < num_seqs and q_lens[num_decodes] == 1:
            num_decodes += 1
        num_verify = 0  # verify rows (a decode and its drafts) right after the decodes
        while num_decodes + num_verify < num_seqs and getattr(
            scheduled[num_decodes + num_verify], "spec_token_ids", None
        ):
            num_verify += 1

        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        ctx = starts + q_lens
        total = int(qsl[-1])
        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
        positions = np.arange(total, dtype=np.int64) - np.repeat(qsl[:-1] - starts, q_lens)

        tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        for i, s in enumerate(scheduled):
            ids = s.block_ids
            tables[i, : len(ids)] = ids
        slots = tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        logits_idx = qsl[1:][sample_order] - 1
        if num_verify:  # 1 + k rows per request with k drafts: e - k .. e
            rows = np.asarray(num_drafts, dtype=np.int64) + 1
            first_row = np.repeat(np.cumsum(rows) - rows, rows)
            logits_idx = np.repeat(logits_idx - rows + 1, rows) + (
                np.arange(int(rows.sum())) - first_row
            )

        dev = self.device
        verify = None
        if num_verify:
            end = num_decodes + num_verify
            v_qsl, v_mask, v_qidx, v_oidx = verify_layout_arrays(
                q_lens[num_decodes:end], ctx[num_decodes:end]
            )
            verify = VerifyLayout(
                num_seqs=num_verify,
                num_tokens=int(v_qsl[-1]),
                query_start_loc=self._to(v_qsl, dev),
                mask=self._to(v_mask, dev),
                query_index=None if v_qidx is None else self._to(v_qidx, dev),
                output_index=None if v_oidx is None else self._to(v_oidx, dev),
            )
        meta = AttentionMetadata(
            slot_mapping=self._to(slots, dev),
            query_start_loc=self._to(qsl.astype(np.int32), dev),
            context_lens=self._to(ctx.astype(np.int32), dev),
            block_tables=self._to(tables, dev),
            num_decode_seqs=num_decodes,
            max_query_len=int(q_lens.max()) if num_seqs else 0,
            max_context_len=int(ctx.max()) if num_seqs else 0,
            verify=verify,
        )
        return ModelInput(
            input_ids=self._to(np.asarray(token_ids, dtype=np.int64), dev),
            positions=self._to(positions, dev),
            meta=meta,
            logits_indices=self._to(np.asarray(logits_idx, dtype=np.int64), dev),
            sample_order=sample_order,
            num_drafts=num_drafts,
        )

    def _to(self, arr: np.ndarray, dev: torch.device) -> torch.Tensor:
        t = torch.from_numpy(arr)
        if dev.type == "cpu":
            return t
        if self._pin:
            t = t.pin_memory()
        return t.to(dev, non_blocking=True)

    # -- step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduler_output: Any) -> RunnerOutput:
        """Run one step for ``scheduler_output.scheduled`` and sample.

        Returns:
            ``RunnerOutput`` with the sampled token per request that completed its prompt (or
            recompute) this step, and logprobs where asked.
        """
        t_start = time.perf_counter()
        scheduled = _decodes_first(scheduler_output.scheduled)
        if not scheduled:
            return RunnerOutput({}, {}, 0.0)
        inp = self.prepare(scheduled)
        if self.sync_timing:
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        prepare_s = t0 - t_start
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(inp.meta):
            hidden = self.cuda_graphs.run(inp.input_ids, inp.positions, inp.meta)
        else:
            hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)
        if not inp.sample_order:
            if self.sync_timing:
                torch.cuda.synchronize(self.device)
            return RunnerOutput({}, {}, time.perf_counter() - t0, prepare_s)
        logits = self.model.compute_logits(hidden[inp.logits_indices])
        if self.sync_timing:
            torch.cuda.synchronize(self.device)
        t1 = time.perf_counter()
        forward_s = t1 - t0

        sampled: dict[str, int | list[int]] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        sampling = [scheduled[i] for i in inp.sample_order]
        if any(inp.num_drafts):  # speculative decoding: verify each request's drafts
            rows: list[int] = []
            plain: list[Any] = []
            row = 0
            for s, k in zip(sampling, inp.num_drafts, strict=True):
                if k == 0:
                    rows.append(row)
                    plain.append(s)
                else:
                    sampled[s.request.request_id] = self.sampler.verify(
                        logits[row : row + k + 1], s.request, list(s.spec_token_ids)
                    )
                row += k + 1
            logits, sampling = logits[rows], plain
        if sampling:
            self._sample(logits, [s.request for s in sampling], sampled, logprobs)
        return RunnerOutput(sampled, logprobs, forward_s, prepare_s, time.perf_counter() - t1)

    def _sample(
        self,
        logits: torch.Tensor,
        requests: list[Any],
        sampled: dict[str, int | list[int]],
        logprobs: dict[str, TokenLogprobs],
    ) -> None:
        """One token per request from ``logits`` ``[N, V]`` (row i: ``requests[i]``) into
        ``sampled`` / ``logprobs``; a grammar accepts its request's token. The sampler reads
        each ``Request`` itself (``SamplingState``'s attributes)."""
        # every change to the logits (grammar mask included) is the sampler's logits pipeline
        results = self.sampler.sample(logits, requests)
        for r, res in zip(requests, results, strict=True):
            sampled[r.request_id] = int(res.token_id)
            if r.structured_output is not None:
                r.structured_output.accept(int(res.token_id))
            if res.logprobs is not None:
                logprobs[r.request_id] = res.logprobs


def _decodes_first(scheduled: list[Any]) -> list[Any]:
    """Stable partition: single-token queries (decodes), then verify rows (a decode with draft
    tokens), then prefill chunks, as ``AttentionMetadata`` requires. The scheduler already puts
    decodes first; this keeps the runner correct whatever order it gets."""
    rank = [
        0 if s.num_new_tokens == 1 else 1 if getattr(s, "spec_token_ids", None) else 2
        for s in scheduled
    ]
    if all(a <= b for a, b in zip(rank, rank[1:], strict=False)):
        return scheduled
    return [s for _, s in sorted(zip(rank, scheduled, strict=True), key=lambda p: p[0])]
