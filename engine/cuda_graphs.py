"""CUDA graphs for decode-only steps (``EngineConfig.cuda_graphs``, default off).

A decode step of B sequences launches a few hundred small kernels whose launch cost dominates
on a GPU at small B. As in vLLM, the model forward of a decode-only batch is captured once per
padded batch size (1, 2, 4, 8, then multiples of 8 up to ``max_num_seqs``) into a
``torch.cuda.CUDAGraph`` over static input buffers, and replayed: the step copies its inputs
into the buffers, pads the batch up to the captured size and reads the first B rows of the
static output.

Correct by construction:
- padded rows have slot -1 (``reshape_and_cache`` skips them: no KV write), context length 1 and
  block table row 0; their outputs are discarded;
- the block-table buffer is as wide as the longest sequence (``max_model_len`` tokens), so every
  real table fits; unused columns are zeroed and never read past ``context_lens``;
- only the Triton kernels are captured (they never synchronize with the host); the torch
  backend reads lengths on the host and is refused at start-up (``check_cuda_graphs``);
- mixed prefill/decode steps, and batches larger than the largest captured size, run eagerly.
"""

from __future__ import annotations

from typing import Any

import torch
from prefixgate.engine.attention_metadata import AttentionMetadata


def check_cuda_graphs(enabled: bool, device: str, attention_backend: str | None) -> None:
    """Refuse ``cuda_graphs=True`` where it cannot work, at start-up.

    Raises:
        ValueError: on a non-CUDA device, or with ``attention_backend="torch"`` (its kernels
            read sequence lengths on the host, which a graph cannot capture).
    """
    if not enabled:
        return
    if not str(device).startswith("cuda"):
        raise ValueError(f"cuda_graphs=True needs a CUDA device, got device {device!r}")
    if attention_backend == "torch":
        raise ValueError(
            "cuda_graphs=True needs attention_backend='triton' (the torch backend synchronizes "
            "with the host inside the forward)"
        )


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded decode batch sizes to capture: 1, 2, 4, 8, 16, 24, ... up to ``max_num_seqs``."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted(set(sizes) | {max_num_seqs})


class DecodeCudaGraphs:
    """Captured decode forwards, one per padded batch size, captured lazily on first use.

    Args:
        model: the ``CausalLM`` (``model(input_ids, positions, kv_caches, meta) -> [T, H]``).
        kv_caches: the per-layer ``(k, v)`` caches (captured by address: never reallocated).
        max_num_seqs: the largest decode batch to capture.
        max_blocks_per_seq: block-table width (``ceil(max_model_len / block_size)``).
        block_size: tokens per KV block.
        device: the CUDA device.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        self.max_blocks = max_blocks_per_seq
        self.block_size = block_size
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: Any = None  # the graphs' shared memory pool handle (torch's _POOL_HANDLE)

    def can_run(self, meta: AttentionMetadata) -> bool:
        """True for a decode-only batch that fits the captured sizes and table width."""
        b = meta.num_seqs
        return (
            0 < b <= self.max_batch
            and meta.num_decode_seqs == b
            and meta.block_tables.shape[1] <= self.max_blocks
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Replay (capturing first if needed) the graph of the padded size; returns ``[B, H]``
        (a view of the graph's static output: valid until the next replay)."""
        b = meta.num_seqs
        size = next(s for s in self.sizes if s >= b)
        width = meta.block_tables.shape[1]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.context_lens[:b].copy_(meta.context_lens)
        self.block_tables[:b, :width].copy_(meta.block_tables)
        self.block_tables[:b, width:].zero_()
        if size > b:  # padding rows: no KV write, one key read from block 0
            self.input_ids[b:size].zero_()
            self.positions[b:size].zero_()
            self.slot_mapping[b:size].fill_(-1)
            self.context_lens[b:size].fill_(1)
            self.block_tables[b:size].zero_()
        if size not in self.graphs:
            self._capture(size)
        self.graphs[size].replay()
        return self.outputs[size][:b]

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            context_lens=self.context_lens[:size],
            block_tables=self.block_tables[:size],
            num_decode_seqs=size,
            max_query_len=1,
            max_context_len=self.max_blocks * self.block_size,
        )

    @torch.inference_mode()
    def _capture(self, size: int) -> None:
        """Warm up (Triton JIT, allocator) on a side stream, then capture the forward."""
        args = (self.input_ids[:size], self.positions[:size], self.kv_caches, self._meta(size))
        # The slots being captured now are whatever run() copied in: the warm-up writes this
        # step's K/V exactly as the replay that follows will (same values, same slots).
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.model(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model(*args)
        self.pool = graph.pool()
        self.graphs[size] = graph
        self.outputs[size] = out
