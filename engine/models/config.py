"""The model's shape and numerics, read from a Hugging Face ``config.json`` or a built-in preset."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.models.errors import ModelFileNotFoundError
from prefixgate.engine.models.hub import resolve_model
from prefixgate.engine.models.presets import PRESETS

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


@dataclass(slots=True)
class ModelConfig:
    """Everything the model code needs, normalized across Llama / Mistral / Qwen2 / Qwen3.

    Attributes:
        architecture: Hugging Face class name, one of ``SUPPORTED_ARCHITECTURES``.
        hidden_size: H, the residual stream width.
        num_layers: decoder layers.
        num_heads: query heads (Hq).
        num_kv_heads: key/value heads (Hkv, GQA when < Hq).
        head_dim: D; the config's ``head_dim`` or ``hidden_size // num_heads``.
        intermediate_size: SwiGLU MLP width (I).
        vocab_size: V, rows of the embedding and of the LM head.
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE base.
        rope_scaling: ``None`` or a dict with ``rope_type`` (``"linear"``, ``"llama3"``) and its
            parameters, as in Hugging Face's config.
        tie_word_embeddings: LM head shares the embedding matrix.
        qkv_bias: q/k/v projections carry a bias (Qwen2; Llama/Qwen3 ``attention_bias``).
        o_bias: output projection carries a bias (Llama/Qwen3 ``attention_bias``).
        mlp_bias: MLP projections carry a bias (Llama ``mlp_bias``).
        qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
        max_position_embeddings: longest position the checkpoint supports (tokens).
        max_model_len: longest prompt + output the engine serves (tokens).
        eos_token_ids: end-of-sequence ids of config.json and generation_config.json.
        bos_token_id: beginning-of-sequence id, or ``None``.
        dtype: torch dtype of weights and activations.
        device: ``"cpu"`` or ``"cuda"`` (or ``"cuda:N"``).
        model_path: the checkpoint directory, or ``None`` for a preset.
        preset: name of the built-in preset, or ``None``.
        initializer_range: std of the normal used for dummy weights.
        hf_config: the raw config dict (after overrides).
    """

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    max_model_len: int
    eos_token_ids: set[int]
    bos_token_id: int | None
    dtype: torch.dtype
    device: str
    model_path: str | None = None
    preset: str | None = None
    initializer_range: float = 0.02
    hf_config: dict[str, Any] = field(default_factory=dict)

    @property
    def attention_bias(self) -> bool:
        """True when the q/k/v projections carry a bias (Qwen2 style)."""
        return self.qkv_bias

    @property
    def q_size(self) -> int:
        """Width of the query projection: ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection: ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K plus V for one token across all layers (KV cache sizing)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.kv_size * itemsize

    @classmethod
    def from_engine_config(cls, cfg: EngineConfig) -> ModelConfig:
        """Build the model config for ``cfg``.

        ``cfg.model`` is a folder or a Hugging Face hub id ``org/name`` (fetched into the hub
        cache: :func:`prefixgate.engine.models.hub.resolve_model`). Reads
        ``<folder>/config.json`` (and ``generation_config.json`` for extra EOS ids),
        applies ``cfg.hf_overrides``; with ``cfg.model is None`` (or a preset name such as
        ``"tiny-random"`` that is not a directory) uses the built-in preset.

        Raises:
            ModelFileNotFoundError (a FileNotFoundError and ValueError): missing directory or
                config.json.
            ValueError: unsupported architecture, unsupported dtype / activation / rope type,
                inconsistent head counts, or ``cfg.max_model_len`` above the model's limit.
        """
        preset: str | None = None
        model_path: str | None = None
        generation: dict[str, Any] = {}
        if cfg.model is None or (cfg.model in PRESETS and not Path(cfg.model).exists()):
            preset = cfg.model or "tiny-random"
            raw = dict(PRESETS[preset])
        else:
            path = Path(resolve_model(cfg.model, weights=cfg.load_format != "dummy"))
            if not path.is_dir():
                raise ModelFileNotFoundError(f"model directory {str(path)!r} does not exist")
            config_file = path / "config.json"
            if not config_file.is_file():
                raise ModelFileNotFoundError(f"missing {config_file} (the model's config.json)")
            raw = _read_json(config_file)
            gen_file = path / "generation_config.json"
            if gen_file.is_file():
                generation = _read_json(gen_file)
            model_path = str(path)
        raw.update(cfg.hf_overrides or {})
        return cls._from_dict(raw, generation, cfg, model_path, preset)

    @classmethod
    def _from_dict(
        cls,
        raw: dict[str, Any],
        generation: dict[str, Any],
        cfg: EngineConfig,
        model_path: str | None,
        preset: str | None,
    ) -> ModelConfig:
        arch = _architecture(raw)
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(
                f"unsupported hidden_act {act!r} (only SwiGLU with silu is implemented)"
            )
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        head_dim = int(raw.get("head_dim") or hidden // heads)
        theta, scaling = _rope(raw)
        attention_bias = bool(raw.get("attention_bias") or False)
        qkv_bias = True if arch == "Qwen2ForCausalLM" else attention_bias
        o_bias = False if arch in ("Qwen2ForCausalLM", "MistralForCausalLM") else attention_bias
        max_pos = int(raw.get("max_position_embeddings") or 2048)
        max_len = _max_model_len(raw, arch, max_pos, cfg.max_model_len)
        eos = _ids(raw.get("eos_token_id")) | _ids(generation.get("eos_token_id"))
        bos = raw.get("bos_token_id", generation.get("bos_token_id"))
        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias") or False),
            qk_norm=arch == "Qwen3ForCausalLM",
            max_position_embeddings=max_pos,
            max_model_len=max_len,
            eos_token_ids=eos,
            bos_token_id=int(bos) if isinstance(bos, int) else None,
            dtype=resolve_dtype(cfg.dtype, raw),
            device=resolve_device(cfg.device),
            model_path=model_path,
            preset=preset,
            initializer_range=float(raw.get("initializer_range", 0.02)),
            hf_config=raw,
        )


def resolve_dtype(requested: str | torch.dtype, raw: dict[str, Any]) -> torch.dtype:
    """Torch dtype for ``requested``; ``"auto"`` is the checkpoint's (``torch_dtype`` or
    ``dtype`` in config.json), float32 when the config names none.

    Raises:
        ValueError: a dtype other than float32 / bfloat16 / float16.
    """
    if isinstance(requested, torch.dtype):
        name = str(requested).removeprefix("torch.")
    elif requested == "auto":
        name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    else:
        name = str(requested)
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; expected float32, bfloat16 or float16")
    return _DTYPES[name]


def resolve_device(requested: str) -> str:
    """``"auto"`` → ``"cuda"`` when CUDA is available, else ``"cpu"``; other names pass through.

    Raises:
        ValueError: ``"cuda"`` asked for on a machine without CUDA.
    """
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(requested).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {requested!r} requested but CUDA is not available")
    return str(requested)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if not archs:
        raise ValueError(
            f"config.json names no architecture; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ValueError(
        f"unsupported architecture {archs[0]!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the legacy keys or transformers 5's
    ``rope_parameters``."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling")
    theta = float(raw.get("rope_theta") or params.pop("rope_theta", None) or 10000.0)
    params.pop("rope_theta", None)
    if scaling is None and params:
        scaling = params
    if scaling:
        scaling = dict(scaling)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling["rope_type"] = kind
        if kind == "default":
            return theta, None
        if kind not in ("linear", "llama3"):
            raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: linear, llama3")
    return theta, scaling or None


def _max_model_len(raw: dict[str, Any], arch: str, max_pos: int, requested: int | None) -> int:
    limit = max_pos
    window = raw.get("sliding_window")
    uses_window = arch == "MistralForCausalLM" or bool(raw.get("use_sliding_window"))
    if uses_window and window and int(window) < limit:
        # No sliding-window attention here: stay within the window so results stay exact.
        logger.warning(
            "sliding_window %d < max_position_embeddings %d: capping max_model_len at %d",
            window,
            max_pos,
            window,
        )
        limit = int(window)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len {requested} exceeds the model's limit of {limit} tokens "
            "(max_position_embeddings / sliding_window)"
        )
    return requested


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}
