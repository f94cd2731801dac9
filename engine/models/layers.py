"""Building blocks of the Llama family: RMSNorm, attention over the paged KV cache, SwiGLU MLP.

Every op goes through the kernels namespace (``prefixgate.kernels.get_backend``) so the same
module runs the torch reference on CPU and the Triton kernels on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from prefixgate.engine.attention_metadata import AttentionMetadata, VerifyLayout
from prefixgate.engine.models.config import ModelConfig
from torch import nn

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class BatchViews:
    """The metadata slices attention needs, computed once per forward (not per layer).

    Decodes come first (one query token each), then verify rows (``meta.verify``: a decode and
    its drafts), then prefill chunks; ``*_tokens`` are the first token index of each group.
    """

    meta: AttentionMetadata
    num_decodes: int
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    verify: VerifyLayout | None
    verify_block_tables: torch.Tensor
    verify_context_lens: torch.Tensor
    prefill_tokens: int
    has_prefill: bool
    prefill_block_tables: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    prefill_context_lens: torch.Tensor

    @classmethod
    def of(cls, meta: AttentionMetadata) -> BatchViews:
        nd = meta.num_decode_seqs
        verify = meta.verify
        nv = 0 if verify is None else verify.num_seqs
        first = nd + nv  # first prefill sequence
        # decodes hold one token each, so the first prefill token sits at nd + the verify tokens
        first_token = nd + (0 if verify is None else verify.num_tokens)
        return cls(
            meta=meta,
            num_decodes=nd,
            decode_block_tables=meta.block_tables[:nd],
            decode_context_lens=meta.context_lens[:nd],
            verify=verify,
            verify_block_tables=meta.block_tables[nd:first],
            verify_context_lens=meta.context_lens[nd:first],
            prefill_tokens=first_token,
            has_prefill=meta.num_seqs > first,
            prefill_block_tables=meta.block_tables[first:],
            prefill_query_start_loc=meta.query_start_loc[first:] - first_token,
            prefill_context_lens=meta.context_lens[first:],
        )


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) with an optional fused residual add.

    ``forward(x [T, H])`` → ``[T, H]``; ``forward(x, residual)`` → ``(out, x + residual)``.
    """

    def __init__(self, size: int, eps: float, kernels: SimpleNamespace) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernels = kernels

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    """Multi-head attention with GQA, RoPE and optional Qwen3 q/k norm over a paged KV cache.

    Projections: one merged ``qkv_proj [H → (Hq + 2 Hkv) * D]`` (fewer matmuls on CPU) and
    ``o_proj [Hq * D → H]``; the loader fills ``qkv_proj`` from HF's q/k/v_proj tensors.
    """

    def __init__(self, cfg: ModelConfig, kernels: SimpleNamespace) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.q_size
        self.kv_size = cfg.kv_size
        self.scale = cfg.head_dim**-0.5
        self.kernels = kernels
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels) if cfg.qk_norm else None

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: KVCache,
        views: BatchViews,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        """``hidden [T, H]`` → ``[T, H]``; writes this step's K/V into ``kv_cache`` first."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        q = q.reshape(num_tokens, self.num_heads, self.head_dim).contiguous()
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim).contiguous()
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.kernels.rotary_embedding(positions, q, k, cos_sin_cache)
        k_cache, v_cache = kv_cache
        self.kernels.reshape_and_cache(k, v, k_cache, v_cache, views.meta.slot_mapping)
        out = self._attend(q, k_cache, v_cache, views)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def _attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, views: BatchViews
    ) -> torch.Tensor:
        nd, first = views.num_decodes, views.prefill_tokens
        verify = views.verify is not None
        if nd and not verify and not views.has_prefill:
            return self._decode(q, k_cache, v_cache, views)
        if not nd and not verify:
            return self._prefill(q, k_cache, v_cache, views)
        if verify and not nd and not views.has_prefill:
            return self._verify(q, k_cache, v_cache, views)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, views)
        if verify:
            out[nd:first] = self._verify(q[nd:first], k_cache, v_cache, views)
        if views.has_prefill:
            out[first:] = self._prefill(q[first:], k_cache, v_cache, views)
        return out

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, views: BatchViews
    ) -> torch.Tensor:
        """Paged decode attention of the batch's decode rows ``q`` (``[num_decodes, Hq, D]``)."""
        return self.kernels.paged_attention_decode(
            q, k_cache, v_cache, views.decode_block_tables, views.decode_context_lens, self.scale
        )

    def _verify(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, views: BatchViews
    ) -> torch.Tensor:
        """Attention of the batch's verify rows ``q`` (``[T_verify, Hq, D]``): a decode and its
        drafts per sequence, decode-like over the layout built once per step."""
        lay = views.verify
        assert lay is not None
        return self.kernels.paged_attention_verify(
            q,
            k_cache,
            v_cache,
            views.verify_block_tables,
            lay.query_start_loc,
            views.verify_context_lens,
            self.scale,
            lay.mask,
            lay.query_index,
            lay.output_index,
        )

    def _prefill(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, views: BatchViews
    ) -> torch.Tensor:
        """Paged prefill attention of the batch's prefill rows ``q`` (``[T_prefill, Hq, D]``)."""
        return self.kernels.paged_attention_prefill(
            q,
            k_cache,
            v_cache,
            views.prefill_block_tables,
            views.prefill_query_start_loc,
            views.prefill_context_lens,
            self.scale,
        )


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))``, gate/up merged."""

    def __init__(self, cfg: ModelConfig, kernels: SimpleNamespace) -> None:
        super().__init__()
        self.kernels = kernels
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` → ``[T, H]``."""
        return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block; the residual add is fused into the next RMSNorm."""

    def __init__(self, cfg: ModelConfig, kernels: SimpleNamespace) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, kernels)
        self.mlp = MLP(cfg, kernels)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        views: BatchViews,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(hidden [T, H], residual [T, H])``; their sum is the block's output."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, views, cos_sin_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual
