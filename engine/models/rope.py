"""Rotary position embedding tables (Su et al. 2021, "RoFormer"), with Llama 3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """``[D/2]`` fp32 inverse frequencies ``theta ** (-2i / D)``, rescaled per ``scaling``.

    ``scaling["rope_type"] == "llama3"`` applies Meta's Llama 3.1 rule (keys ``factor``,
    ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``): wavelengths
    longer than ``original / low_freq_factor`` are divided by ``factor``, shorter than
    ``original / high_freq_factor`` kept, and those between interpolated smoothly (the same
    rule as Hugging Face's ``_compute_llama3_parameters``). ``"linear"`` positions are divided
    by ``factor`` (applied in :func:`build_cos_sin_cache`).
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling and scaling.get("rope_type") == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > original / low
    short_wave = wavelen < original / high
    scaled = torch.where(long_wave, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    return torch.where(~long_wave & ~short_wave, blended, scaled)


def build_cos_sin_cache(
    head_dim: int,
    max_positions: int,
    theta: float,
    scaling: dict[str, Any] | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The ``[max_positions, D]`` fp32 table the kernels' ``rotary_embedding`` reads.

    Row p holds ``cos(p * inv_freq)`` in its first D/2 columns and ``sin(p * inv_freq)`` in
    its last D/2 columns (half-split / GPT-NeoX layout, as Hugging Face Llama).
    """
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    positions = torch.arange(max_positions, dtype=torch.float32)
    if scaling and scaling.get("rope_type") == "linear":
        positions = positions / float(scaling["factor"])
    freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
