"""Compile every Triton kernel for an sm_90 (H100/H200) target on CPU, no GPU needed.

The interpreter accepts code the GPU compiler rejects (non-constexpr globals, loop-carried
type changes, dot shape limits). ``triton.compile`` runs the whole pipeline (TTIR → PTX →
cubin with the bundled ptxas) without a device, in a subprocess with ``TRITON_INTERPRET=0``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

PTR_TYPES = {  # pointer args whose element type does not follow the data dtype
    "block_tables_ptr": "*i32",
    "context_lens_ptr": "*i32",
    "query_start_loc_ptr": "*i32",
    "slot_mapping_ptr": "*i64",
    "positions_ptr": "*i64",
    "cos_sin_ptr": "*fp32",
    "part_acc_ptr": "*fp32",
    "part_ml_ptr": "*fp32",
    "qweight_ptr": "*i8",
    "wscale_ptr": "*fp32",
}
FLOAT_ARGS = {"scale_log2", "eps"}

# (module, kernel, data dtype, constexprs, num_warps, num_stages): the launches the wrappers make.
CASE_FIELDS = ("module", "kernel", "dtype", "constexprs", "num_warps", "num_stages")


def _decode(dtype: str, groups: int, head_dim: int, block_size: int, splits: int, dot: str):
    """A ``_decode_kernel`` launch (GQA group padded to 16 rows, 64-token tiles)."""
    consts = dict(GROUPS=groups, G_PAD=16, HEAD_DIM=head_dim, D_PAD=head_dim)
    consts.update(BLOCK_SIZE=block_size, TILE_N=64, NUM_SPLITS=splits, DOT_PRECISION=dot)
    return ("triton_decode", "_decode_kernel", dtype, consts, 4, 2)


def _prefill(dtype: str, groups: int, head_dim: int, num_warps: int):
    """A ``_prefill_kernel`` launch (16-token blocks, 64 x 64 tiles, TF32 dots)."""
    consts = dict(GROUPS=groups, HEAD_DIM=head_dim, D_PAD=head_dim, BLOCK_SIZE=16)
    consts.update(BLOCK_M=64, BLOCK_N=64, DOT_PRECISION="tf32")
    return ("triton_prefill", "_prefill_kernel", dtype, consts, num_warps, 2)


def _int8(dtype: str, bias: bool, block_m: int, dot: str):
    """An ``_int8_linear_kernel`` launch (64 x 64 N/K tiles, 4 warps, 3 stages)."""
    consts = dict(HAS_BIAS=bias, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, DOT_PRECISION=dot)
    return ("triton_int8", "_int8_linear_kernel", dtype, consts, 4, 3)


CASES = {
    "decode-splits-bf16-d128-g4": _decode("bf16", 4, 128, 16, 4, "tf32"),
    "decode-1split-fp32-d64-g3": _decode("fp32", 3, 64, 32, 1, "ieee"),
    "decode-reduce": (
        "triton_decode",
        "_decode_reduce_kernel",
        "bf16",
        dict(HEAD_DIM=128, D_PAD=128, NUM_SPLITS=4, SPLITS_PAD=4),
        2,
        1,
    ),
    "prefill-bf16-d128-g4": _prefill("bf16", 4, 128, 8),
    "prefill-fp16-d16-g1": _prefill("fp16", 1, 16, 4),
    "reshape-and-cache": (
        "triton_kv_cache",
        "_reshape_and_cache_kernel",
        "bf16",
        dict(NUM_HEADS=3, HEAD_DIM=64, H_PAD=4, D_PAD=64),
        4,
        1,
    ),
    "rms-norm-residual": (
        "triton_norm",
        "_rms_norm_kernel",
        "bf16",
        dict(HAS_RESIDUAL=True, BLOCK=1024),
        4,
        1,
    ),
    "rotary": (
        "triton_rotary",
        "_rotary_kernel",
        "bf16",
        dict(NUM_Q_HEADS=9, NUM_K_HEADS=3, HALF=32, HALF_PAD=32, HQ_PAD=16, HK_PAD=4),
        4,
        1,
    ),
    "silu-and-mul": ("triton_activation", "_silu_and_mul_kernel", "bf16", dict(BLOCK=1024), 8, 1),
    "int8-linear-bf16-decode": _int8("bf16", False, 16, "ieee"),
    "int8-linear-fp16-bias-prefill": _int8("fp16", True, 64, "ieee"),
    "int8-linear-fp32-tf32": _int8("fp32", False, 32, "tf32"),
}
SLOW = {
    "prefill-fp16-d16-g1",
    "decode-1split-fp32-d64-g3",
    "int8-linear-fp32-tf32",
}  # PREFIXGATE_SLOW=1

_SCRIPT = textwrap.dedent("""
    import json, os, sys, warnings
    warnings.simplefilter("ignore")
    os.environ["TRITON_INTERPRET"] = "0"
    import importlib
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    results = {}
    for spec in json.loads(sys.argv[1]):
        fn = getattr(importlib.import_module("prefixgate.kernels." + spec["module"]), spec["kernel"])
        sig, consts = {}, {}
        for name in fn.arg_names:
            if name in spec["constexprs"]:
                sig[name], consts[name] = "constexpr", spec["constexprs"][name]
            elif name.endswith("_ptr"):
                sig[name] = spec["ptr_types"].get(name, "*" + spec["dtype"])
            else:
                sig[name] = "fp32" if name in spec["floats"] else "i32"
        try:
            kernel = triton.compile(
                ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                options={"num_warps": spec["num_warps"], "num_stages": spec["num_stages"]})
            results[spec["case"]] = {"shared_bytes": kernel.metadata.shared, "cubin": len(kernel.asm["cubin"])}
        except Exception as exc:
            results[spec["case"]] = {"error": str(exc)[-2000:]}
    print(json.dumps(results))
""")


def _backend_available() -> bool:
    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except Exception:
        return False
    return True


def _compile(cases: list[str]) -> dict[str, dict]:
    floats = sorted(FLOAT_ARGS)
    specs = [
        dict(
            zip(CASE_FIELDS, CASES[case], strict=True),
            case=case,
            ptr_types=PTR_TYPES,
            floats=floats,
        )
        for case in cases
    ]
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(specs)],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(cases: list[str]) -> None:
    if not _backend_available():
        pytest.skip("triton's NVIDIA backend is not installed")
    results = _compile(cases)
    for case in cases:
        info = results[case]
        assert "error" not in info, f"{case}: {info.get('error')}"
        assert info["cubin"] > 0
        assert info["shared_bytes"] <= 227 * 1024, case  # H100/H200 shared memory per block


def test_kernels_compile_for_sm90():
    """One launch configuration of every kernel, in one compiler process."""
    _check([c for c in CASES if c not in SLOW])


@pytest.mark.slow
def test_more_configs_compile_for_sm90():
    _check(sorted(SLOW))
