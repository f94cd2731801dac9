"""Building blocks of the Llama family: RMSNorm, attention over the paged KV cache, SwiGLU MLP.

Every op goes through the kernels namespace (``prefixgate.kernels.get_backend``) so the same
module runs the torch reference on CPU and the Triton kernels on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from prefixgate.engine.attention_metadata import AttentionMetadata, VerifyLayout
from prefixgate.engine.models.config import ModelConfig
from prefixgate.kernels import cpu_ext
from prefixgate.kernels.paged import PagedKV
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


def set_one_row_ops(model: nn.Module, on: bool) -> int:
    """Route the one-row (single decode token) paths of ``model``'s :class:`RMSNorm`,
    :class:`Attention` and :class:`MLP` through prefixgate's fused CPU ops
    (:mod:`prefixgate.kernels.cpu_ext`: add + RMSNorm, rotary + KV write + paged attention,
    SiLU * mul; ~8 ops a layer instead of ~70) when ``on``, or back to the kernels namespace.
    Only fp32 CPU rows take them (checked per call); the results differ from the torch
    reference in the last bits (the attention's and the norm's summation order; tolerances in
    ``cpu_ext``), so the loader turns them on only for models past
    ``cpu_linear.CALIBRATION_MIN_BYTES`` (the test models are below it).

    Returns:
        the number of modules set.

    Raises:
        RuntimeError: ``on`` where :func:`prefixgate.kernels.cpu_ext.available` is False.
    """
    return _set_flag(model, (RMSNorm, Attention, MLP), "one_row_ops", on, "one-row fused ops")


def set_decode_ops(model: nn.Module, on: bool) -> int:
    """Route the batched fp32 and bf16 CPU paths of ``model``'s :class:`RMSNorm` (any row count: the
    residual add + norm), :class:`MLP` (SiLU * mul) and :class:`Attention` (a step of decode
    tokens only: rotary + KV write + paged attention read through the block tables in place;
    other steps: rotary + KV write in one pass, and the prefill rows' paged attention read
    through the block tables where the AVX-512 kernel takes the shape) through prefixgate's
    CPU ops (:mod:`prefixgate.kernels.cpu_ext`) when ``on``, or back to the kernels
    namespace: one C++ call where torch ran several ops, each with its own pass
    over memory, and no gathered copy of K/V per layer. Results differ from the torch
    reference in the last bits, as :func:`set_one_row_ops`' (tolerances in ``cpu_ext``); the
    loader sets both for the same models.

    Returns:
        the number of modules set.

    Raises:
        RuntimeError: ``on`` where :func:`prefixgate.kernels.cpu_ext.available` is False.
    """
    return _set_flag(model, (RMSNorm, Attention, MLP), "decode_ops", on, "batched CPU ops")


def set_one_row_layers(model: nn.Module, on: bool) -> int:
    """Run each :class:`DecoderLayer` of ``model`` as one ``cpu_ext.decode_layer`` call on a
    step of one decode token alone (one C++ call a layer instead of ~8 ops and the modules'
    Python between them) when ``on``; a layer whose linears do not all have a one-row spec
    (FBGEMM's packed int8 weight has none), or with q/k norms, keeps its modules. The results
    are those of :func:`set_one_row_ops`' fused ops bit for bit (the same C++ functions in the
    same order); the loader sets both for models past ``cpu_linear.CALIBRATION_MIN_BYTES``.

    Returns:
        the number of layers set.

    Raises:
        RuntimeError: ``on`` where :func:`prefixgate.kernels.cpu_ext.available` is False.
    """
    return _set_flag(model, (DecoderLayer,), "one_row_layer", on, "one-row decoder layers")


def _set_flag(model: nn.Module, kinds: tuple[type, ...], attr: str, on: bool, what: str) -> int:
    """Set ``attr = on`` on every module of ``model`` of one of ``kinds``; how many were set.
    Bumps ``cpu_ext.one_row_generation`` (cached layer specs are rebuilt).

    Raises:
        RuntimeError: ``on`` where :func:`prefixgate.kernels.cpu_ext.available` is False.
    """
    if on and not cpu_ext.available():
        raise RuntimeError(f"{what} need prefixgate's CPU ops (not built here)")
    n = 0
    for m in model.modules():
        if isinstance(m, kinds):
            setattr(m, attr, on)
            n += 1
    cpu_ext.one_row_changed()
    return n


def one_decode_alone(views: BatchViews, hidden: torch.Tensor) -> bool:
    """True for a step of one decode token and nothing else, as an fp32 CPU row: the steps
    :meth:`DecoderLayer.forward` takes with ``one_row``."""
    return (
        views.num_decodes == 1
        and views.verify is None
        and not views.has_prefill
        and _one_cpu_row(hidden)
    )


def decode_attention_args(
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: KVCache,
    views: BatchViews,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
) -> cpu_ext.DecodeAttentionArgs:
    """The arguments of ``cpu_ext.decode_attention`` after ``qkv`` for a step of one decode
    token alone (its block table, context length and slot from ``views``)."""
    k_cache, v_cache = kv_cache
    return (
        positions,
        cos_sin_cache,
        k_cache,
        v_cache,
        views.decode_block_tables,
        views.decode_context_lens,
        views.meta.slot_mapping,
        num_heads,
        num_kv_heads,
        scale,
    )


def _one_cpu_row(x: torch.Tensor) -> bool:
    """True for a ``[1, H]`` fp32 CPU tensor (the rows the fused ops take)."""
    return x.dim() == 2 and x.shape[0] == 1 and x.dtype == torch.float32 and x.device.type == "cpu"


BATCHED_OPS_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes of rows (and KV caches) the batched CPU ops take (:func:`set_decode_ops`)."""


def _cpu_rows(x: torch.Tensor) -> bool:
    """True for a ``[T, H]`` fp32 or bf16 CPU tensor, ``T >= 1`` (the rows the batched ops
    take)."""
    return (
        x.dim() == 2
        and x.shape[0] >= 1
        and x.dtype in BATCHED_OPS_DTYPES
        and x.device.type == "cpu"
    )


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) with an optional fused residual add.

    ``forward(x [T, H])`` → ``[T, H]``; ``forward(x, residual)`` → ``(out, x + residual)``.
    """

    one_row_ops = False
    """One fp32 CPU row through ``cpu_ext.add_rms_norm`` (:func:`set_one_row_ops`)."""

    decode_ops = False
    """fp32 or bf16 CPU rows (any count) through ``cpu_ext.add_rms_norm``
    (:func:`set_decode_ops`)."""

    def __init__(self, size: int, eps: float, kernels: SimpleNamespace) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernels = kernels

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        fused = (self.one_row_ops and _one_cpu_row(x)) or (self.decode_ops and _cpu_rows(x))
        if fused and self.weight.dtype == x.dtype:
            out, total = cpu_ext.add_rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, total)
        return self.kernels.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    """Multi-head attention with GQA, RoPE and optional Qwen3 q/k norm over a paged KV cache.

    Projections: one merged ``qkv_proj [H → (Hq + 2 Hkv) * D]`` (fewer matmuls on CPU) and
    ``o_proj [Hq * D → H]``; the loader fills ``qkv_proj`` from HF's q/k/v_proj tensors.
    """

    one_row_ops = False
    """A step of one decode token (nothing else) through ``cpu_ext.decode_attention``
    (:func:`set_one_row_ops`); not with q/k norms."""

    decode_ops = False
    """A step of decode tokens only (any count) through ``cpu_ext.decode_attention``, other
    steps' rotary and KV write through ``cpu_ext.rotary_cache`` (:func:`set_decode_ops`; not
    with q/k norms) and their prefill rows' attention through ``cpu_ext.prefill_attention``
    where the AVX-512 kernel takes the shape (q/k norms too)."""

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
        qkv = self.qkv_proj(hidden)
        if (self.one_row_ops or self.decode_ops) and self._fused_decode(qkv, kv_cache, views):
            args = decode_attention_args(
                positions,
                cos_sin_cache,
                kv_cache,
                views,
                self.num_heads,
                self.num_kv_heads,
                self.scale,
            )
            out = cpu_ext.decode_attention(qkv, *args)
            return self.o_proj(out)
        k_cache, v_cache = kv_cache
        if self.decode_ops and self._fused_rotary(qkv, kv_cache):
            q = cpu_ext.rotary_cache(
                qkv,
                positions,
                cos_sin_cache,
                k_cache,
                v_cache,
                views.meta.slot_mapping,
                self.num_heads,
                self.num_kv_heads,
            )
            out = self._attend(
                q.view(num_tokens, self.num_heads, self.head_dim), k_cache, v_cache, views
            )
            return self.o_proj(out.reshape(num_tokens, self.q_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        q = q.reshape(num_tokens, self.num_heads, self.head_dim).contiguous()
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim).contiguous()
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.kernels.rotary_embedding(positions, q, k, cos_sin_cache)
        self.kernels.reshape_and_cache(k, v, k_cache, v_cache, views.meta.slot_mapping)
        out = self._attend(q, k_cache, v_cache, views)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def _fused_decode(self, qkv: torch.Tensor, kv_cache: KVCache, views: BatchViews) -> bool:
        """Whether this step takes ``cpu_ext.decode_attention``: decode tokens only (one alone
        for ``one_row_ops``, any count for ``decode_ops``), fp32 (or bf16 for ``decode_ops``)
        on CPU, no q/k norm, contiguous caches of the rows' dtype."""
        k_cache, v_cache = kv_cache
        rows = _cpu_rows(qkv) if self.decode_ops else _one_cpu_row(qkv)
        return (
            views.num_decodes == qkv.shape[0]
            and views.verify is None
            and not views.has_prefill
            and self.q_norm is None
            and rows
            and k_cache.dtype == v_cache.dtype == qkv.dtype
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
        )

    def _fused_rotary(self, qkv: torch.Tensor, kv_cache: KVCache) -> bool:
        """Whether this step's rotary and KV write take ``cpu_ext.rotary_cache``: fp32 or bf16
        rows on CPU, no q/k norm, contiguous caches of the rows' dtype."""
        k_cache, v_cache = kv_cache
        return (
            self.q_norm is None
            and _cpu_rows(qkv)
            and k_cache.dtype == v_cache.dtype == qkv.dtype
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
        )

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
        kv = PagedKV(k_cache, v_cache, views.decode_block_tables, views.decode_context_lens)
        return self.kernels.paged_attention_decode(q, kv, self.scale)

    def _verify(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, views: BatchViews
    ) -> torch.Tensor:
        """Attention of the batch's verify rows ``q`` (``[T_verify, Hq, D]``): a decode and its
        drafts per sequence, decode-like over the layout built once per step."""
        lay = views.verify
        assert lay is not None
        kv = PagedKV(k_cache, v_cache, views.verify_block_tables, views.verify_context_lens)
        return self.kernels.paged_attention_verify(
            q,
            kv,
            lay.query_start_loc,
            self.scale,
            lay.mask,
            lay.query_index,
            lay.output_index,
        )

    def _prefill(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, views: BatchViews
    ) -> torch.Tensor:
        """Paged prefill attention of the batch's prefill rows ``q`` (``[T_prefill, Hq, D]``)."""
        kv = PagedKV(k_cache, v_cache, views.prefill_block_tables, views.prefill_context_lens)
        if self.decode_ops and self._fused_prefill(q, k_cache, v_cache):
            return cpu_ext.prefill_attention(q, kv, views.prefill_query_start_loc, self.scale)
        return self.kernels.paged_attention_prefill(
            q, kv, views.prefill_query_start_loc, self.scale
        )

    def _fused_prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Whether prefill rows ``q`` (``[T, Hq, D]``) take ``cpu_ext.prefill_attention``: fp32
        or bf16 on CPU, contiguous caches of their dtype, and a head size and group the
        AVX-512 kernel takes here (``cpu_ext.prefill_attention_supported``)."""
        return (
            q.device.type == "cpu"
            and q.dtype in BATCHED_OPS_DTYPES
            and k_cache.dtype == v_cache.dtype == q.dtype
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and cpu_ext.prefill_attention_supported(
                self.head_dim, self.num_heads // self.num_kv_heads
            )
        )


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))``, gate/up merged."""

    def __init__(self, cfg: ModelConfig, kernels: SimpleNamespace) -> None:
        super().__init__()
        self.kernels = kernels
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    one_row_ops = False
    """One fp32 CPU row's activation through ``cpu_ext.silu_mul`` (:func:`set_one_row_ops`)."""

    decode_ops = False
    """fp32 or bf16 CPU rows' activation (any count) through ``cpu_ext.silu_mul``
    (:func:`set_decode_ops`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` → ``[T, H]``."""
        gate_up = self.gate_up_proj(x)
        if (self.one_row_ops and _one_cpu_row(gate_up)) or (self.decode_ops and _cpu_rows(gate_up)):
            return self.down_proj(cpu_ext.silu_mul(gate_up))
        return self.down_proj(self.kernels.silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block; the residual add is fused into the next RMSNorm."""

    def __init__(self, cfg: ModelConfig, kernels: SimpleNamespace) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, kernels)
        # (cpu_ext.one_row_generation when built, _layer_args()): a plain attribute
        self._one_row_args: tuple[int, tuple[Any, ...] | None] = (-1, None)
        self.mlp = MLP(cfg, kernels)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)

    one_row_layer = False
    """A step of one decode token alone through one ``cpu_ext.decode_layer`` call
    (:func:`set_one_row_layers`)."""

    def _one_row_args_for(self, kv_cache: KVCache) -> tuple[Any, ...] | None:
        """This layer's cached arguments of ``cpu_ext.decode_layer`` for a step that
        :func:`one_decode_alone` admits; None where it cannot take it: not set, q/k norms, a
        linear without a one-row spec, or caches other than contiguous fp32."""
        if not self.one_row_layer:
            return None
        gen = cpu_ext.one_row_generation()
        if self._one_row_args[0] != gen:  # kinds or modules changed since: build them again
            self._one_row_args = (gen, self._layer_args())
        args = self._one_row_args[1]
        k_cache, v_cache = kv_cache
        if args is None or not (
            k_cache.dtype == v_cache.dtype == torch.float32
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
        ):
            return None
        return args

    def _layer_args(self) -> tuple[Any, ...] | None:
        """The layer's own arguments of ``cpu_ext.decode_layer`` (norm weights, eps, its
        ``layer_linears``, head counts, softmax scale), or None where it cannot take it (q/k
        norms, a linear without a one-row spec). Cached by :meth:`_one_row_args_for` until
        ``cpu_ext.one_row_generation`` moves: looking them up through the modules each step
        cost a tenth of a step (docs/benchmarks/cpu-gemm.md)."""
        attn = self.self_attn
        if attn.q_norm is not None:
            return None
        specs = []
        for linear in (attn.qkv_proj, attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj):
            spec_of = getattr(linear, "one_row_spec", None)
            spec = None if spec_of is None else spec_of()
            if spec is None:
                return None
            specs.append(spec)
        return (
            self.input_layernorm.weight,
            self.post_attention_layernorm.weight,
            self.input_layernorm.eps,
            cpu_ext.layer_linears((specs[0], specs[1], specs[2], specs[3])),
            attn.num_heads,
            attn.num_kv_heads,
            attn.scale,
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        views: BatchViews,
        cos_sin_cache: torch.Tensor,
        one_row: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(hidden [T, H], residual [T, H])``; their sum is the block's output.

        ``one_row``: the step is one decode token alone (:func:`one_decode_alone`); where this
        layer can take it (:func:`set_one_row_layers`), the whole layer is one
        ``cpu_ext.decode_layer`` call, bit for bit the ops below."""
        if one_row and (args := self._one_row_args_for(kv_cache)) is not None:
            norm1, norm2, eps, linears, num_heads, num_kv_heads, scale = args
            attention = decode_attention_args(
                positions, cos_sin_cache, kv_cache, views, num_heads, num_kv_heads, scale
            )
            return cpu_ext.decode_layer(hidden, residual, norm1, norm2, eps, linears, *attention)
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, views, cos_sin_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual
