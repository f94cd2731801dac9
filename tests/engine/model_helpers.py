"""Test helpers: drive a CausalLM through its own paged KV cache without the scheduler.

``PagedRunner`` owns per-layer K/V caches, hands out blocks from a shuffled free list (so block
tables are not contiguous), builds ``AttentionMetadata`` (decodes first) and returns the logits
of each sequence's last new token. ``tiny_hf_model`` builds a small random transformers model
and saves it with ``save_pretrained`` for loader/logit tests.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from prefixgate.engine.attention_metadata import AttentionMetadata
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.models.config import ModelConfig
from prefixgate.engine.models.llama import CausalLM
from prefixgate.engine.models.loader import load_model


class PagedRunner:
    """A minimal model runner over a paged KV cache (tests only).

    Args:
        model: the loaded CausalLM.
        num_blocks: KV blocks per layer.
        block_size: tokens per block.
        seed: shuffles the free block list.
    """

    def __init__(self, model: CausalLM, num_blocks: int = 64, block_size: int = 4, seed: int = 0):
        cfg = model.config
        self.model = model
        self.block_size = block_size
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        device = model.model.norm.weight.device
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=cfg.dtype, device=device),
                torch.zeros(shape, dtype=cfg.dtype, device=device),
            )
            for _ in range(cfg.num_layers)
        ]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[Any, list[int]] = {}
        self.lens: dict[Any, int] = {}

    def step(self, batch: list[tuple[Any, list[int]]]) -> torch.Tensor:
        """Feed each ``(seq_id, new_token_ids)``; returns ``[B, V]`` fp32 logits of each
        sequence's last new token, in the order of ``batch``.

        Entries with one new token and an existing context run as decodes (placed first).
        """
        is_decode = [len(t) == 1 and self.lens.get(s, 0) > 0 for s, t in batch]
        order = [i for i in range(len(batch)) if is_decode[i]]
        order += [i for i in range(len(batch)) if not is_decode[i]]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        ctx: list[int] = []
        for i in order:
            seq, tokens = batch[i]
            start = self.lens.get(seq, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            for pos in range(start, end):
                slots.append(
                    table[pos // self.block_size] * self.block_size + pos % self.block_size
                )
            ids += tokens
            positions += range(start, end)
            starts.append(starts[-1] + len(tokens))
            ctx.append(end)
            self.lens[seq] = end
        width = max(len(self.tables[batch[i][0]]) for i in order)
        tables = [
            self.tables[batch[i][0]] + [0] * (width - len(self.tables[batch[i][0]])) for i in order
        ]
        device = self.kv_caches[0][0].device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            context_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            num_decode_seqs=sum(is_decode),
            max_query_len=max(len(batch[i][1]) for i in order),
            max_context_len=max(ctx),
        )
        hidden = self.model(
            torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            self.kv_caches,
            meta,
        )
        last = torch.tensor(starts[1:], device=device) - 1
        logits = self.model.compute_logits(hidden[last])
        out = torch.empty_like(logits)
        out[torch.tensor(order, device=device)] = logits
        return out

    def free_seq(self, seq: Any) -> None:
        """Return a sequence's blocks to the free list."""
        self.free += self.tables.pop(seq, [])
        self.lens.pop(seq, None)


def load(path: str | Path | None = None, **engine_fields: Any) -> CausalLM:
    """Load a model directory (or the preset with ``path=None``) on CPU in fp32 by default."""
    fields = {"dtype": "float32", "device": "cpu", **engine_fields}
    cfg = EngineConfig(model=None if path is None else str(path), **fields)
    return load_model(ModelConfig.from_engine_config(cfg), cfg)


def tiny_hf_model(kind: str, out_dir: Path, seed: int = 0, **overrides: Any):
    """Build a small random transformers model of ``kind`` and ``save_pretrained`` it.

    Kinds: ``llama`` (GQA, untied), ``llama_tied``, ``llama_bias``, ``llama3_rope``,
    ``llama_linear_rope``, ``mistral``, ``qwen2`` (q/k/v bias), ``qwen3`` (q/k norm, head_dim != hidden/heads).
    Returns the transformers model in eval mode (fp32).
    """
    import transformers as tf

    common: dict[str, Any] = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        initializer_range=0.08,
        bos_token_id=1,
        eos_token_id=2,
    )
    builders = {
        "llama": (tf.LlamaConfig, {}),
        "llama_tied": (tf.LlamaConfig, {"tie_word_embeddings": True}),
        "llama_bias": (tf.LlamaConfig, {"attention_bias": True, "mlp_bias": True}),
        "llama3_rope": (
            tf.LlamaConfig,
            {
                "rope_theta": 500000.0,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
            },
        ),
        "llama_linear_rope": (
            tf.LlamaConfig,
            {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        ),
        "mistral": (tf.MistralConfig, {"sliding_window": None, "head_dim": 16}),
        "qwen2": (tf.Qwen2Config, {}),
        "qwen3": (tf.Qwen3Config, {"head_dim": 32}),
    }
    config_cls, extra = builders[kind]
    config = config_cls(**{**common, **extra, **overrides})
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # HF init leaves norms at 1 and biases at 0: randomize them too
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(out_dir)
    return model
