"""The Llama-family causal LM (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from prefixgate.engine.attention_metadata import AttentionMetadata
from prefixgate.engine.models.config import ModelConfig
from prefixgate.engine.models.layers import (
    BatchViews,
    DecoderLayer,
    KVCache,
    RMSNorm,
    one_decode_alone,
)
from prefixgate.engine.models.rope import build_cos_sin_cache
from torch import nn


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.*`` tensors)."""

    def __init__(self, cfg: ModelConfig, kernels: SimpleNamespace) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, kernels) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)


class CausalLM(nn.Module):
    """A decoder-only LM: ``forward`` gives hidden states, ``compute_logits`` the LM head.

    Built by :func:`prefixgate.engine.models.loader.load_model` (weights loaded, eval mode,
    on ``cfg.device``). Parameter names follow Hugging Face except the merged
    ``self_attn.qkv_proj`` and ``mlp.gate_up_proj``.
    """

    def __init__(self, cfg: ModelConfig, kernels: SimpleNamespace) -> None:
        super().__init__()
        self.config = cfg
        self.kernels = kernels
        self.model = LlamaModel(cfg, kernels)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.cos_sin_cache: torch.Tensor | None = None
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config ties them."""
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_rope(self) -> None:
        """Build the ``[max_model_len, D]`` fp32 cos/sin table on the model's device."""
        cfg = self.config
        self.cos_sin_cache = build_cos_sin_cache(
            cfg.head_dim,
            max(cfg.max_model_len, 1),
            cfg.rope_theta,
            cfg.rope_scaling,
            device=self.model.norm.weight.device,  # the embedding may be a packed view
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Run one flat batch (decodes first, then prefill chunks).

        Args:
            input_ids: ``[T]`` int64 token ids.
            positions: ``[T]`` int64 absolute positions (< ``max_model_len``).
            kv_caches: one ``(k_cache, v_cache)`` per layer, each ``[N, S, Hkv, D]``; this
                step's K/V are written at ``meta.slot_mapping``.
            meta: the batch's attention metadata.

        Returns:
            ``[T, H]`` final hidden states (after the last RMSNorm), in the model's dtype.

        Raises:
            ValueError: ``kv_caches`` does not hold one entry per layer.
        """
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(
                f"expected {len(self.model.layers)} (k_cache, v_cache) pairs, got {len(kv_caches)}"
            )
        if self.cos_sin_cache is None:
            self.init_rope()
        views = BatchViews.of(meta)
        hidden = self.model.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        one_row = one_decode_alone(views, hidden)
        cos_sin = self.cos_sin_cache
        assert cos_sin is not None  # init_rope above
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            assert isinstance(layer, DecoderLayer)
            # one_row: one C++ call for the layer where it can take it (set_one_row_layers)
            hidden, residual = layer(positions, hidden, residual, kv_cache, views, cos_sin, one_row)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, H]`` → ``[N, V]`` float32 logits."""
        return self.lm_head(hidden).float()
