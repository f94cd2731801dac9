"""``load_model``: build the CausalLM, fill it from safetensors (or dummy weights), move to device."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import torch
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.cuda_graphs import check_cuda_graphs
from prefixgate.engine.malloc import heap_in_use
from prefixgate.engine.models.config import ModelConfig
from prefixgate.engine.models.cpu_linear import (
    CALIBRATION_MIN_BYTES,
    calibrate_one_row,
    decide_gemm_rows,
    pack_linears,
    use_onednn_linear,
    warm_up_row_counts,
)
from prefixgate.engine.models.layers import set_decode_ops, set_one_row_layers, set_one_row_ops
from prefixgate.engine.models.llama import CausalLM
from prefixgate.engine.models.quantization import (
    calibrate_int8_one_row,
    check_quantization,
    quantize_model,
)
from prefixgate.engine.models.weights import iter_tensors, weight_files
from prefixgate.kernels import cpu_ext, default_backend, get_backend

logger = logging.getLogger(__name__)

# HF tensor suffix → (our merged parameter suffix, shard index) for stacked projections.
_STACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER_TENSOR = re.compile(r"^(model\.layers\.\d+\.)([a-z_]+\.[a-z_]+)\.(weight|bias)$")
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|rotary_emb\.cos_cached|rotary_emb\.sin_cached)$")


def load_model(model_config: ModelConfig, engine_config: EngineConfig) -> CausalLM:
    """Build the model of ``model_config`` with weights, in eval mode, on its device and dtype.

    Weights come from ``model.safetensors`` or a sharded ``model.safetensors.index.json`` in
    ``model_config.model_path`` (HF tensor names; ``lm_head.weight`` absent when embeddings are
    tied), cast to ``model_config.dtype``. With ``engine_config.load_format == "dummy"`` or a
    preset, the weights are seeded random (``engine_config.seed``) and this is logged.

    Raises:
        ModelFileNotFoundError: missing weights file or shard.
        ValueError: an unsupported quantization / cuda_graphs / device / dtype combination
            (before any
            weight is read), a tensor with an unexpected shape, or an expected tensor missing (the
            message names the tensor and the file).
    """
    check_quantization(engine_config.quantization, model_config.device, model_config.dtype)
    check_cuda_graphs(
        engine_config.cuda_graphs, model_config.device, engine_config.attention_backend
    )
    device = torch.device(model_config.device)
    kernels = get_backend(engine_config.attention_backend or default_backend(model_config.device))
    with torch.device("meta"):
        model = CausalLM(model_config, kernels)
    model = model.to(dtype=model_config.dtype).to_empty(device=device)
    model.tie_weights()  # to_empty gives tied parameters separate storage: share them again
    if engine_config.load_format == "dummy" or model_config.model_path is None:
        fill_dummy(model, engine_config.seed)
        what = model_config.preset or model_config.model_path
        logger.warning(
            "using dummy random weights (seed %d) for %s %s: its outputs are meaningless",
            engine_config.seed,
            model_config.architecture,
            what,
        )
    else:
        load_weights(model, model_config.model_path)
    linear_bytes = sum(
        m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear)
    )  # fp32 bytes a one-row step streams (the tied head counted: it is read each step)
    if engine_config.quantization is not None:
        quantize_model(model, engine_config.quantization)
        logger.info("quantized every linear layer to %s", engine_config.quantization)
        if device.type == "cpu":
            calibrate_int8_one_row(model)  # batch-1 decode: the AVX2 int8 GEMV where faster
    elif use_onednn_linear(device, model_config.dtype, None):
        pack_linears(model)  # MKL's sgemm is slower (cpu_linear.py, docs/benchmarks/cpu-gemm.md)
        decide_gemm_rows(model)  # builds the C++ ops now where a forward would use them
        calibrate_one_row(model)  # batch-1 decode: the fastest GEMM per shape at one row
        if engine_config.warmup_row_counts:
            _warm_up_row_counts(model, engine_config)
    if (
        device.type == "cpu"
        and model_config.dtype == torch.float32
        and linear_bytes >= CALIBRATION_MIN_BYTES  # as calibrate_one_row: test models keep torch's
        and cpu_ext.available()
    ):
        set_one_row_ops(model, True)  # batch-1 decode: fused norm / attention / activation
        set_one_row_layers(model, True)  # ... and one C++ call a layer where its GEMMs allow
        set_decode_ops(model, True)  # batched steps: norm, activation, decode attention in C++
        logger.info("decode and norms through prefixgate's fused CPU ops")
    elif (
        device.type == "cpu"
        and model_config.dtype == torch.bfloat16
        and linear_bytes >= CALIBRATION_MIN_BYTES
        and cpu_ext.available()
    ):
        set_decode_ops(model, True)  # bf16 rows and KV: the batched ops (one row too)
        logger.info("bf16 norms, activation and decode attention through prefixgate's CPU ops")
    model.init_rope()
    return model.eval().requires_grad_(False)


def _warm_up_row_counts(model: CausalLM, engine_config: EngineConfig) -> None:
    """``warm_up_row_counts`` over the model's linears: the body's up to a step's token budget
    (``max_num_batched_tokens``), the LM head up to the rows a step's logits take (one a
    request, ``1 + num_speculative_tokens`` a request with speculative decoding), logged with
    its time and the heap bytes it took."""
    budget = engine_config.max_num_batched_tokens
    per_request = 1 + (
        engine_config.num_speculative_tokens if engine_config.speculative_method else 0
    )
    head_rows = min(budget, engine_config.max_num_seqs * per_request)
    body = [m for name, m in model.named_modules() if not name.startswith("lm_head")]
    heap0, t0 = heap_in_use(), time.perf_counter()
    gemms = warm_up_row_counts(body, budget) + warm_up_row_counts([model.lm_head], head_rows)
    heap1 = heap_in_use()
    logger.info(
        "warmed %d GEMM shapes (row counts up to %d, LM head up to %d) in %.1f s%s",
        gemms,
        budget,
        head_rows,
        time.perf_counter() - t0,
        "" if heap0 is None or heap1 is None else f", heap +{(heap1 - heap0) / 2**20:.1f} MiB",
    )


@torch.no_grad()
def fill_dummy(model: CausalLM, seed: int) -> None:
    """Seeded random weights: N(0, initializer_range) matrices, unit norms, zero biases.

    Drawn on CPU in fp32 from one ``torch.Generator`` in parameter-name order, so the weights
    are the same on every device and dtype for a given seed.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    std = model.config.initializer_range
    for name, param in model.named_parameters():  # tied weights appear once
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std
            param.copy_(values)


@torch.no_grad()
def load_weights(model: CausalLM, model_dir: str | Path) -> None:
    """Copy every checkpoint tensor into its parameter (slice), checking names and shapes.

    Raises:
        ModelFileNotFoundError: missing weights file or shard.
        ValueError: unexpected shape, or a parameter no checkpoint tensor filled.
    """
    cfg = model.config
    params = dict(model.named_parameters())
    splits = {
        "self_attn.qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size],
        "mlp.gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size],
    }
    expected = _expected_tensors(params, splits)
    files = weight_files(model_dir)
    for name, file, tensor in iter_tensors(files):
        if _IGNORED.search(name):
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # some tied checkpoints still store the head: the embedding wins
        target_name, dest = _destination(name, params, splits)
        if dest is None:
            logger.warning("ignoring unexpected tensor %s in %s", name, file)
            continue
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(
                f"tensor {name} in {file} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dest.shape)} for this config"
            )
        dest.copy_(tensor.to(dest.dtype))
        expected.discard(name)
    if expected:
        missing = sorted(expected)
        where = files[0] if len(files) == 1 else Path(model_dir) / "model.safetensors.index.json"
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"missing tensor {missing[0]}{more} in {where}")


def _destination(
    name: str, params: dict[str, torch.nn.Parameter], splits: dict[str, list[int]]
) -> tuple[str, torch.Tensor | None]:
    """The parameter (or row slice of a merged parameter) that HF tensor ``name`` fills."""
    match = _LAYER_TENSOR.match(name)
    if match and match.group(2) in _STACKED:
        prefix, sub, kind = match.groups()
        merged, shard = _STACKED[sub]
        target = f"{prefix}{merged}.{kind}"
        param = params.get(target)
        if param is None:
            return target, None
        sizes = splits[merged]
        start = sum(sizes[:shard])
        return target, param.narrow(0, start, sizes[shard])
    return name, params.get(name)


def _expected_tensors(
    params: dict[str, torch.nn.Parameter], splits: dict[str, list[int]]
) -> set[str]:
    """HF names of every tensor the checkpoint must hold for these parameters."""
    unstack: dict[str, list[str]] = {}
    for hf_sub, (merged, shard) in _STACKED.items():
        unstack.setdefault(merged, [""] * len(splits[merged]))[shard] = hf_sub
    names: set[str] = set()
    for pname in params:  # named_parameters lists a tied weight once (as the embedding)
        for merged, hf_subs in unstack.items():
            if f".{merged}." in pname:
                names.update(pname.replace(merged, sub) for sub in hf_subs)
                break
        else:
            names.add(pname)
    return names
