"""Paged KV cache storage: how many blocks fit, and the per-layer K/V tensors.

Layout (docs/architecture.md, kernels contract): per layer two tensors
``[num_blocks, block_size, num_kv_heads, head_dim]``, one for K and one for V, in the model's
dtype. A token's cache slot is ``block_id * block_size + offset``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 256 * 1024 * 1024
"""Default KV byte budget on CPU (``EngineConfig.kv_cache_memory`` unset): 256 MiB."""

DEFAULT_CUDA_KV_FRACTION = 0.5
"""Default share of the free device memory (after the model is loaded) given to the KV cache."""

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class KVCacheSpec:
    """Shape of the paged cache of one model.

    Attributes:
        num_layers: decoder layers (one K and one V tensor each).
        num_kv_heads: key/value heads (GQA).
        head_dim: per-head size.
        block_size: tokens per block.
        dtype: element type of K and V.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers, K and V:
        ``2 * layers * block_size * kv_heads * head_dim * itemsize``."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize


def check_gpu_memory_utilization(value: float | None, device: torch.device | str) -> None:
    """Refuse ``gpu_memory_utilization`` (vLLM's ``--gpu-memory-utilization``) where it means
    nothing: on a device that is not CUDA (CPU memory is not shared that way; its budget is
    ``kv_cache_memory``). Checked before the model loads.

    Raises:
        ValueError: ``value`` set and ``device`` not CUDA.
    """
    if value is not None and torch.device(device).type != "cuda":
        raise ValueError(
            f"gpu_memory_utilization applies to a CUDA device, and this engine runs on "
            f"{torch.device(device).type}: size its KV cache with kv_cache_memory instead "
            f"(default {DEFAULT_CPU_KV_BYTES // 2**20} MiB on CPU)"
        )


def utilization_budget(utilization: float, free: int, total: int) -> int:
    """KV bytes under vLLM's ``gpu_memory_utilization``: the share ``utilization`` (0-1] of
    the device's ``total`` bytes this server may hold, less what is already in use once the
    model is loaded (``total - free``: the weights, torch's reserve, other processes):
    ``utilization * total - (total - free)``. Activations are not profiled first, as vLLM
    does, so they come out of the rest (``1 - utilization`` of the device).

    Raises:
        ValueError: nothing is left for the KV cache (the share is already in use).
    """
    used = total - free
    budget = int(utilization * total) - used
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization:g} leaves no memory for the KV cache: "
            f"{used / 2**30:.2f} GiB of the device's {total / 2**30:.2f} GiB are in use once "
            f"the model is loaded, above {utilization:g} of it; raise it or give "
            "kv_cache_memory"
        )
    return budget


def resolve_num_blocks(
    spec: KVCacheSpec,
    num_kv_blocks: int | None,
    kv_cache_memory: int | None,
    device: torch.device | str,
    gpu_memory_utilization: float | None = None,
) -> int:
    """Number of KV blocks to allocate.

    ``num_kv_blocks`` wins when given; else ``kv_cache_memory`` bytes // bytes per block; else
    on CUDA ``utilization_budget`` of ``gpu_memory_utilization`` when given; else 256 MiB on
    CPU, or half the free device memory on CUDA.

    Raises:
        ValueError: the budget does not hold a single block, or ``gpu_memory_utilization``
            off CUDA (``check_gpu_memory_utilization``) or leaving nothing.
    """
    if num_kv_blocks is not None:
        return int(num_kv_blocks)
    budget = kv_cache_memory
    if budget is None and gpu_memory_utilization is not None:
        check_gpu_memory_utilization(gpu_memory_utilization, device)
        free, total = torch.cuda.mem_get_info(torch.device(device))
        budget = utilization_budget(gpu_memory_utilization, free, total)
    if budget is None:
        dev = torch.device(device)
        if dev.type == "cuda":
            free, _total = torch.cuda.mem_get_info(dev)
            budget = int(free * DEFAULT_CUDA_KV_FRACTION)
        else:
            budget = DEFAULT_CPU_KV_BYTES
    num = budget // spec.bytes_per_block
    if num < 1:
        raise ValueError(
            f"kv_cache_memory={budget} bytes holds no KV block "
            f"(one block needs {spec.bytes_per_block} bytes)"
        )
    return int(num)


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device | str) -> KVCaches:
    """Allocate zeroed K and V tensors ``[num_blocks, block_size, num_kv_heads, head_dim]`` per
    layer on ``device``; returns ``[(k, v)] * num_layers`` (distinct tensors)."""
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    caches = [
        (
            torch.zeros(shape, dtype=spec.dtype, device=device),
            torch.zeros(shape, dtype=spec.dtype, device=device),
        )
        for _ in range(spec.num_layers)
    ]
    logger.info(
        "KV cache: %d blocks x %d tokens, %.1f MiB (%s)",
        num_blocks,
        spec.block_size,
        num_blocks * spec.bytes_per_block / 2**20,
        spec.dtype,
    )
    return caches
