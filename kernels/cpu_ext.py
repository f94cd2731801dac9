"""prefixgate's own CPU ops (one-row GEMVs and layers, batched small ops), built on first use.

``kernels/csrc/cpu_ops.cpp`` is compiled with ``torch.utils.cpp_extension.load`` (g++,
``-O3 -mavx2 -mfma -ffp-contract=off -fopenmp``) into torch's extensions cache (``TORCH_EXTENSIONS_DIR``,
by default ``~/.cache/torch_extensions``; never the repository), in a folder named by a hash of
the source and flags (:func:`extension_name`), and registered as
``torch.ops.prefixgate_cpu.*`` (``TORCH_LIBRARY``, no pybind). The first build took 20-22 s on
the dev machine (2 cores, AMD EPYC Zen 3, g++ 12); later processes load the cached library.
The ops' threads are ``at::parallel_for``'s: torch's own OpenMP pool, at
``torch.get_num_threads()`` (:func:`op_threads` says how many a parallel op takes).

:func:`available` builds (once per process) and says whether the ops can be used; it returns
False, with a log line, on a CPU without AVX2 / FMA, without a compiler, when the build fails,
or with ``PREFIXGATE_CPU_EXT=0`` in the environment. Callers then keep the torch paths.
A build killed part-way (Ctrl-C during the first ``prefixgate serve`` of a large model) leaves
torch's ``lock`` file in the build folder, on which every later ``load`` would wait forever:
:func:`clear_stale_lock` removes it when no process holds it open (on Linux; elsewhere once it
is :data:`STALE_LOCK_S` old) and waits for a live build otherwise.

Ops (fp32, CPU, unless said; tolerances as the tests check them against the torch reference):

- :func:`gemv`: ``y [1, N] = x [1, K] @ W^T + bias`` on :func:`pack_panels`' layout or on
  oneDNN's packed weight read in place (wider panels). fp32
  accumulation, four partial sums per output (k mod 4), so results differ from MKL's / oneDNN's
  in the last bits: within ``rtol=1e-5, atol=1e-5`` (plus ~1e-6 * sqrt(K) on unit inputs).
- :func:`gemv_int8`: the same GEMV on int8 panels (:func:`pack_panels_int8`) with one fp32
  scale per output row: ``x @ (q * scale)^T + bias`` with fp32 activations.
- :func:`gemv_int8` with ``activations="int16"``: the same product with the activations
  quantized per row to int16 and exact int32 pair products (:func:`pack_pairs_int8`' layout);
  error at most ``0.5 * amax(|x|) / 32767 * sum_k |q * scale|`` per output.
- :func:`gemv_int8` with ``activations="int8"``: activations quantized per 32 columns to int8
  and exact int32 block sums (:func:`pack_quads_int8`' layout; AVX-VNNI where the CPU has it);
  error at most ``sum_b 0.5 * amax(|x_b|) / 127 * sum_{k in b} |q * scale|`` per output.
- :func:`add_rms_norm`: the residual add + RMSNorm of ``torch_ref.rms_norm``, row by row; the
  sum is exact (same fp32 add), the mean square differs in summation order (``rtol=1e-6``).
- :func:`silu_mul`: ``torch_ref.silu_and_mul`` row by row (an AVX2 ``exp``; ``rtol=1e-6``).
- :func:`decode_layer`: a whole pre-norm decoder layer for one decode token alone (the ops
  above in ``DecoderLayer.forward``'s order, its linears by :data:`LINEAR_KINDS`): one call a
  layer instead of ~8, the same results bit for bit as calling them one by one.
- :func:`decode_attention`: rotary + KV-cache write + paged attention of B decode tokens
  (``torch_ref.rotary_embedding`` + ``reshape_and_cache`` + ``paged_attention_decode``); the
  rotary and the cache write are bit-exact, the attention (fp32, one pass of scores, softmax
  with the max subtracted) within ``rtol=1e-5, atol=1e-6`` of SDPA.
- :func:`rotary_cache`: its rotary + KV-cache write alone, for T tokens of any step
  (bit-exact).
- :func:`prefill_attention`: ``torch_ref.paged_attention_prefill`` (causal, a varlen batch of
  chunks after any cached prefix) read through the block tables in place, on AVX-512 only
  (:func:`prefill_attention_supported`); fp32 within ``atol=5e-6`` of the float64 result.

The batched ops (:func:`add_rms_norm`, :func:`silu_mul`, :func:`rotary_cache`,
:func:`decode_attention`) take bf16 rows and a bf16 KV cache as well (one dtype for all their
tensors but the fp32 cos/sin table): values are loaded into fp32 registers, computed in fp32 and
rounded to bf16 where ``torch_ref`` run in bf16 rounds (an op's output, the residual sum, the
normalized row before the weight, SiLU before the product), so the sums, the rotary and the cache
writes are the reference's bit for bit and the rest within bf16's tolerance; the attention keeps
scores and probabilities in fp32 (within half a bf16 ulp of fp32 SDPA on the same bf16 values).
Stores round to nearest even with AVX512_BF16's ``vcvtneps2bf16`` where the CPU has it
(:func:`bf16_native`; it flushes denormals to zero), otherwise with AVX2 integer operations
(c10's ``round_to_nearest_even``, the same bits for every normal value); set
``PREFIXGATE_CPU_EXT_AVX512BF16=0`` to force the latter.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
from prefixgate.kernels.paged import PagedKV

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
"""The C++ source of every op (one file: one compile)."""

PANEL = 8
"""Output rows per panel of :func:`pack_panels` (one AVX2 register of fp32)."""

DISABLE_ENV = "PREFIXGATE_CPU_EXT"
"""Set to ``0`` to never build or use the ops (the torch paths stay)."""

CFLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"]
"""Compiler flags: AVX2 + FMA intrinsics (the AVX-512 kernels carry their own ``target``
attribute and are chosen at run time); no contraction of plain ``a * b + c`` into FMAs, so the
rotary's products and sums are the torch reference's bit for bit; OpenMP, without which
``at::parallel_for`` (an inline template over ``#pragma omp parallel``) runs the whole range on
the calling thread: every op ran on one thread until ``-fopenmp`` was added."""

LDFLAGS = ["-fopenmp"]
"""Linker flags: the library needs ``libgomp.so.1``, which resolves to the copy torch loaded
first (torch's wheel ships its own; one OpenMP runtime, one thread pool)."""


def extension_name(
    cflags: list[str] | None = None,
    ldflags: list[str] | None = None,
    source: Path = SOURCE,
) -> str:
    """The library's name in torch's extensions cache, one per source and build:
    ``prefixgate_cpu_ops_<12 hex digits>``, a SHA-256 of the source's bytes, the compiler and
    linker flags (default :data:`CFLAGS`, :data:`LDFLAGS`) and torch's version. torch keeps one
    build folder per name and rebuilds it whenever the source it finds there differs, so two
    checkouts of different sources (a dev tree beside CI) under one name rebuilt over each other
    at every start; under this name each source keeps its own folder, and the same source the
    same name in every process.

    Raises:
        OSError: ``source`` cannot be read.
    """
    digest = hashlib.sha256()
    digest.update(source.read_bytes())
    for part in (
        cflags if cflags is not None else CFLAGS,
        ldflags if ldflags is not None else LDFLAGS,
    ):
        digest.update(b"\0" + "\x1f".join(part).encode())
    digest.update(b"\0" + torch.__version__.encode())
    return f"prefixgate_cpu_ops_{digest.hexdigest()[:12]}"


EXTENSION_NAME = extension_name()
"""The name of the library built with :data:`CFLAGS` from this checkout's :data:`SOURCE`
(:func:`extension_name`); the build without OpenMP has its own."""


STALE_LOCK_S = 180.0
"""Seconds after which torch's build ``lock`` counts as left by a killed build where no
:func:`lock_holders` answer can be had: several times a build's time on a 2-core machine
(docs/benchmarks/cpu-gemm.md), so a live one is done long before."""


def lock_holders(lock: Path) -> bool | None:
    """Whether a process on this machine holds ``lock`` open (torch's ``FileBaton`` keeps it
    open for the whole build); None where that cannot be told: no ``/proc`` (not Linux), or a
    process whose open files cannot be read (another user's)."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    target = str(lock.resolve())
    unknown = False
    for pid in proc.iterdir():
        if not pid.name.isdigit():
            continue
        try:
            fds = list((pid / "fd").iterdir())
        except FileNotFoundError:  # exited meanwhile
            continue
        except PermissionError:
            unknown = True
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    return True
            except OSError:
                continue
    return None if unknown else False


def clear_stale_lock(
    build_dir: str | os.PathLike[str], stale_after_s: float = STALE_LOCK_S, poll_s: float = 0.2
) -> bool:
    """Wait until ``build_dir/lock`` is gone or stale, and remove it in the second case, with
    one warning; True when a stale lock was removed.

    Stale: no process on this machine holds it open (:func:`lock_holders`; a live build does),
    or, where that cannot be told, older than ``stale_after_s`` seconds (its mtime: torch's
    ``FileBaton`` creates it once and never touches it). A lock that appears again after this
    returns belongs to a live build, which torch waits on.
    """
    lock = Path(build_dir) / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return False
        held = lock_holders(lock)
        if held is False or (held is None and age > stale_after_s):
            try:
                lock.unlink()
            except FileNotFoundError:
                return False
            why = "no process holds it" if held is False else f"{age:.0f} s old"
            logger.warning("removed a stale build lock %s (%s: a killed build left it)", lock, why)
            return True
        time.sleep(poll_s)


def cpu_supports_avx2() -> bool:
    """True on x86-64 where torch's own dispatch reports AVX2 or better (AVX2 implies FMA
    on every CPU torch selects it for)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return False
    return cap in ("AVX2", "AVX512")


@functools.cache
def available() -> bool:
    """Build (or load from the cache) the ops once per process; True when they can be used.

    Never raises: a failed build logs a warning and returns False (:func:`_build_ops`).
    """
    if os.environ.get(DISABLE_ENV, "1") == "0":
        logger.info("prefixgate CPU ops off (%s=0): torch paths only", DISABLE_ENV)
        return False
    if not cpu_supports_avx2():
        logger.info("prefixgate CPU ops need x86-64 with AVX2/FMA: torch paths only")
        return False
    if hasattr(torch.ops, "prefixgate_cpu") and hasattr(torch.ops.prefixgate_cpu, "gemv_packed"):
        return True
    return _build_ops()


def _build_ops() -> bool:
    """Build and load the library with :data:`CFLAGS`; where that fails, once more without
    OpenMP (a compiler without it: every op then runs on the calling thread, said in the log);
    False, with a warning, when neither builds."""
    serial = [flag for flag in CFLAGS if flag != "-fopenmp"]
    for cflags, ldflags, how in ((CFLAGS, LDFLAGS, ""), (serial, [], " without OpenMP")):
        t0 = time.perf_counter()
        try:
            _build(cflags, ldflags)
        except Exception as exc:  # no compiler, no ninja, a build error
            failed = exc
            if how == "":
                logger.warning("prefixgate CPU ops did not build (%s): trying without OpenMP", exc)
            continue
        if how:
            logger.warning("prefixgate CPU ops built without OpenMP: each op on one thread")
        # "built", not "ready": the server's own line says when it is ready ("model ... ready"),
        # and this one now comes during the load, before it
        logger.info("prefixgate CPU ops built%s in %.1f s", how, time.perf_counter() - t0)
        return True
    logger.warning("prefixgate CPU ops unavailable (%s): torch paths only", failed)
    return False


def source_in(build_dir: Path, source: Path = SOURCE) -> Path:
    """The copy of ``source`` the build compiles: ``build_dir/<its file name>``, written when
    absent or different (atomically: a temporary file renamed over it), left alone otherwise.

    Why: the command ninja runs names the source's path, and ninja rebuilds when the command
    changes, so two checkouts of the same source, sharing one folder under
    :func:`extension_name`, rebuilt over each other at every start (22-31 s each on a 2-core
    machine). From the folder's own copy the command is the same for every checkout. The
    folder's name hashes the source's bytes, so the copy there never changes, and it is never
    rewritten with equal bytes (a newer file would make ninja rebuild).

    Raises:
        OSError: ``source`` cannot be read or ``build_dir`` written.
    """
    data = source.read_bytes()
    copy = build_dir / source.name
    try:
        if copy.read_bytes() == data:
            return copy
    except FileNotFoundError:
        pass
    build_dir.mkdir(parents=True, exist_ok=True)
    tmp = build_dir / f".{source.name}.{os.getpid()}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, copy)
    return copy


def _build(cflags: list[str], ldflags: list[str]) -> None:
    """``torch.utils.cpp_extension.load`` of :data:`SOURCE` (its copy in the build folder,
    :func:`source_in`) with these flags, its ops registered.

    Raises:
        Exception: whatever the build raises (no compiler, no ninja, a compile error), or
            AttributeError when the library loaded without registering its ops.
    """
    from torch.utils.cpp_extension import _get_build_directory, load

    name = extension_name(cflags, ldflags)
    build_dir = Path(_get_build_directory(name, verbose=False))
    clear_stale_lock(build_dir)
    load(
        name=name,
        sources=[str(source_in(build_dir))],
        extra_cflags=list(cflags),  # copies: load() appends torch's own flags to the lists
        extra_ldflags=list(ldflags),
        is_python_module=False,
        verbose=False,
    )
    torch.ops.prefixgate_cpu.gemv_packed  # noqa: B018  (registered: raises otherwise)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` fp32 → ``[ceil(N / 8), K, 8]`` contiguous: panel ``p`` holds output rows
    ``8p .. 8p+7`` interleaved per input column (rows past N are zeros), so :func:`gemv` reads
    the whole weight as one forward stream. A copy (``8 * ceil(N / 8) * K`` fp32)."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = weight.new_zeros((panels * PANEL, k), dtype=torch.float32)
    padded[:n] = weight.detach()
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def gemv(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``x [1, K]`` fp32 → ``[1, N]`` fp32 on panels ``packed [P, K, W]``: :func:`pack_panels`'
    layout (``W = 8``) or a view of oneDNN's packed weight
    (``engine/models/cpu_linear.onednn_panels``: ``W`` a multiple of 8 up to 64, each panel's
    ``K x W`` block contiguous, panels ``Kp * W`` apart with ``Kp >= K``). At ``W = 8`` the
    result is bit for bit the old panel GEMV's; wider panels keep one accumulator per 8 rows.

    Raises:
        RuntimeError: wrong dtypes or shapes (the op's checks).
    """
    return torch.ops.prefixgate_cpu.gemv_packed(x, packed, bias, out_features)


def pack_panels_int8(
    qweight: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``qweight [N, K]`` int8, ``scale [N]`` fp32 → (``[ceil(N / 8), K, 8]`` int8 in
    :func:`pack_panels`' layout, ``[8 * ceil(N / 8)]`` fp32 scales; padding rows zero)."""
    n, k = qweight.shape
    panels = -(-n // PANEL)
    padded = qweight.new_zeros((panels * PANEL, k), dtype=torch.int8)
    padded[:n] = qweight
    scales = scale.new_zeros(panels * PANEL, dtype=torch.float32)
    scales[:n] = scale
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous(), scales


INT8_ACTIVATIONS = ("fp32", "int16", "int8")
"""The activations :func:`gemv_int8` may take: fp32 (not quantized), int16 per row, int8 per
block of 32 columns."""


def gemv_int8(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    activations: str = "fp32",
    *,
    vnni: bool = True,
) -> torch.Tensor:
    """``x [1, K]`` fp32 → ``[1, N]`` fp32 ``= scale * (x @ q^T) + bias``.

    ``activations="fp32"``: on :func:`pack_panels_int8`' weight, the int8 weight widened to
    fp32 in registers, fp32 activations and accumulation (no activation quantization, unlike
    FBGEMM's ``linear_dynamic``: closer to ``x @ (q * scale)^T``, within ``rtol=1e-5`` of it in
    float64). ``"int16"`` ("gemv16"): on :func:`pack_pairs_int8`' weight, the activations
    quantized to int16 (one scale a row, absmax → 32,767) and exact int32 products
    (``vpmaddwd``): half the instructions per weight; error against ``x @ (q * scale)^T`` at
    most ``0.5 * amax(|x|) / 32767 * sum_k |q * scale|`` per output (the activations'
    rounding), plus fp32 rounding. ``"int8"`` ("gemv8"): on :func:`pack_quads_int8`' weight,
    the activations quantized to int8 per block of 32 columns (absmax → 127, one fp32 scale a
    block, as ggml's ``quantize_row_q8_0``) and exact int32 sums of a block (``vpmaddubsw`` +
    ``vpmaddwd``, or one AVX-VNNI ``vpdpbusd`` where the CPU has it and ``vnni``; the same sums
    either way, so the same result bit for bit): a quarter of fp32's instructions per weight;
    error at most ``sum_b 0.5 * amax(|x_b|) / 127 * sum_{k in b} |q * scale|`` per output plus
    fp32 rounding. FBGEMM's 8-bit activations (one scale a row) are coarser.

    Raises:
        ValueError: an unknown ``activations``.
        RuntimeError: wrong dtypes or shapes (the op's checks).
    """
    ops = torch.ops.prefixgate_cpu
    if activations == "fp32":
        return ops.gemv_int8_packed(x, packed, scale, bias, out_features)
    if activations == "int16":
        return ops.gemv_int8w16_packed(x, packed, scale, bias, out_features)
    if activations == "int8":
        return ops.gemv_int8x8_packed(x, packed, scale, bias, out_features, vnni)
    raise ValueError(f"unknown activations {activations!r}; expected one of {INT8_ACTIVATIONS}")


def pack_quads_int8(
    qweight: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``qweight [N, K]`` int8 in [-127, 127], ``scale [N]`` fp32 → (``[ceil(N / 8), K32 / 4, 8,
    4]`` int8 with ``K32`` = K rounded up to a multiple of 32: panel ``p``, column quad ``j``, row
    ``r``: ``q[8p + r, 4j .. 4j + 3]``; padding zero), ``[8 * ceil(N / 8)]`` fp32 scales) for
    :func:`gemv_int8` with ``activations="int8"``. -128 is refused (its sign flip overflows).

    Raises:
        ValueError: a weight of -128.
    """
    if bool((qweight == -128).any()):
        raise ValueError("pack_quads_int8: weights must lie in [-127, 127]")
    n, k = qweight.shape
    panels, k32 = -(-n // PANEL), -(-k // 32) * 32
    padded = qweight.new_zeros((panels * PANEL, k32), dtype=torch.int8)
    padded[:n, :k] = qweight
    scales = scale.new_zeros(panels * PANEL, dtype=torch.float32)
    scales[:n] = scale
    packed = padded.view(panels, PANEL, k32 // 4, 4).permute(0, 2, 1, 3).contiguous()
    return packed, scales


def pack_pairs_int8(
    qweight: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``qweight [N, K]`` int8, ``scale [N]`` fp32 → (``[ceil(N / 8), ceil(K / 2), 8, 2]`` int8:
    panel ``p``, column pair ``j``, row ``r``: ``q[8p + r, 2j]``, ``q[8p + r, 2j + 1]``; padding
    zero), ``[8 * ceil(N / 8)]`` fp32 scales) for :func:`gemv_int8` with ``activations="int16"``."""
    n, k = qweight.shape
    panels, pairs = -(-n // PANEL), -(-k // 2)
    padded = qweight.new_zeros((panels * PANEL, pairs * 2), dtype=torch.int8)
    padded[:n, :k] = qweight
    scales = scale.new_zeros(panels * PANEL, dtype=torch.float32)
    scales[:n] = scale
    packed = padded.view(panels, PANEL, pairs, 2).permute(0, 2, 1, 3).contiguous()
    return packed, scales


def bf16_native() -> bool:
    """Whether the ops' bf16 stores use AVX512_BF16's ``vcvtneps2bf16`` (else AVX2 rounding)."""
    return bool(torch.ops.prefixgate_cpu.bf16_native())


def op_threads() -> int:
    """How many threads a parallel op runs on now (``torch.get_num_threads()``, where the
    library was built with OpenMP)."""
    return int(torch.ops.prefixgate_cpu.op_threads())


GEMM_ROWS = 64
"""Most rows :func:`gemm_panels` takes (a decode batch's; prefill chunks stay with oneDNN)."""


def gemm_rows_available() -> bool:
    """True where :func:`gemm_panels` runs: a CPU with AVX512F/DQ/BW/VL and
    ``PREFIXGATE_CPU_EXT_AVX512`` not ``0`` (read at each call)."""
    return bool(torch.ops.prefixgate_cpu.gemm_rows_available())


def gemm_panels(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``x [M, K]`` fp32 (``1 <= M <=`` :data:`GEMM_ROWS`) → ``[M, N]`` fp32 ``= x @ W^T (+
    bias)`` on ``packed [P, K, 64]``, a view of oneDNN's packed weight
    (``engine/models/cpu_linear.onednn_panels`` where its panels are 64 wide: each panel's
    ``K x 64`` block contiguous, panels ``Kp * 64`` apart with ``Kp >= K``). Each output is one
    FMA chain over the input columns in order, fp32 throughout.

    Raises:
        RuntimeError: no AVX-512 here (:func:`gemm_rows_available`), wrong dtypes or shapes
            (the op's checks).
    """
    return torch.ops.prefixgate_cpu.gemm_panels(x, packed, bias, out_features)


def attention_kernel(head_dim: int = 64) -> str:
    """The kernel :func:`decode_attention` takes now at head size ``head_dim``: ``"avx512"``
    (16 lanes: a CPU with AVX512F/DQ/BW/VL, ``head_dim`` 32, 64, 96 or 128, and
    ``PREFIXGATE_CPU_EXT_AVX512`` not ``0``, read at each call) or ``"avx2"``."""
    return str(torch.ops.prefixgate_cpu.decode_attention_kernel(head_dim))


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row: ``(weight * s / sqrt(mean(s^2) + eps), s)`` with ``s = x + residual`` (``s = x``
    without a residual); ``x``, ``residual`` ``[T, H]``, ``weight [H]``, all fp32 or all bf16
    (bf16 rounds the sum, the normalized row and the product, as ``torch_ref.rms_norm``). Rows
    over torch's threads; a row's result is the same at any ``T``."""
    return torch.ops.prefixgate_cpu.add_rms_norm(x, residual, weight, eps)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """Row by row: ``x [T, 2I]`` fp32 or bf16 → ``silu(x[:, :I]) * x[:, I:]`` ``[T, I]`` in its
    dtype (an AVX2 ``exp``, Cephes' ``expf``, within ``rtol=1e-6`` of torch's in fp32; bf16
    rounds SiLU's output before the product, as torch's bf16 ``F.silu`` does)."""
    return torch.ops.prefixgate_cpu.silu_mul(x)


def rotary_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """T tokens (a prefill's, any mix): rotary on q and k, k / v written to the caches at
    ``slot`` (in place; ``-1`` skips): ``torch_ref.rotary_embedding`` + ``reshape_and_cache``
    bit for bit, in one pass over the merged projection (tokens over torch's threads).

    Args:
        qkv: ``[T, (Hq + 2 Hkv) * D]`` fp32 or bf16 (q, then k, then v).
        positions: ``[T]`` int64; slot: ``[T]`` int64.
        cos_sin_cache: ``[max_pos, D]`` fp32; k_cache, v_cache: ``[N, S, Hkv, D]`` contiguous,
            qkv's dtype.

    Returns:
        the rotated q, ``[T, Hq * D]`` in qkv's dtype.

    Raises:
        RuntimeError: wrong dtypes, shapes or an out-of-range position / slot.
    """
    return torch.ops.prefixgate_cpu.rotary_cache(
        qkv, positions, cos_sin_cache, k_cache, v_cache, slot, num_heads, num_kv_heads
    )


def decode_attention(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: torch.Tensor,
    slot: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
) -> torch.Tensor:
    """B decode tokens, one per sequence: rotary on q and k, k / v written to the caches at
    ``slot`` (in place; ``-1`` skips), then each row's attention over its ``context_len``
    cached tokens, read through its block table in place (no gather); rows and heads over
    torch's threads.

    Args:
        qkv: ``[B, (Hq + 2 Hkv) * D]`` fp32 or bf16, the merged projection's rows (q, then k,
            then v).
        positions: ``[B]`` int64.
        cos_sin_cache: ``[max_pos, D]`` fp32 (cos in the first D/2 columns).
        k_cache, v_cache: ``[N, S, Hkv, D]`` contiguous, qkv's dtype.
        block_table: ``[B, max_blocks]`` int32; context_len: ``[B]`` int32 (with this token);
        slot: ``[B]`` int64.
        num_heads, num_kv_heads: Hq, Hkv; scale: the softmax scale.

    Returns:
        ``[B, Hq * D]`` in qkv's dtype.

    Raises:
        RuntimeError: wrong dtypes, shapes or an out-of-range position / slot / length.
    """
    return torch.ops.prefixgate_cpu.decode_attention(
        qkv,
        positions,
        cos_sin_cache,
        k_cache,
        v_cache,
        block_table,
        context_len,
        slot,
        num_heads,
        num_kv_heads,
        scale,
    )


def prefill_attention_supported(head_dim: int, group: int) -> bool:
    """Whether :func:`prefill_attention` runs here for head size ``head_dim`` and ``group``
    query heads a KV head: a CPU with AVX512F/DQ/BW/VL, ``PREFIXGATE_CPU_EXT_AVX512`` not ``0``
    (read at each call), ``head_dim`` a multiple of 16 up to 256, ``1 <= group <= 48``."""
    return bool(torch.ops.prefixgate_cpu.prefill_attention_supported(head_dim, group))


def prefill_attention(
    q: torch.Tensor, kv: PagedKV, query_start_loc: torch.Tensor, scale: float
) -> torch.Tensor:
    """``torch_ref.paged_attention_prefill`` (causal attention of a varlen batch of query
    chunks, each chunk its sequence's last ``q_len`` tokens) read through the block tables in
    place: no gathered copy of K/V, the G query heads of a KV head sharing each K/V load, an
    online softmax over tiles of 32 keys, tiles past a task's last query never read; tasks
    (a sequence, a KV head, up to 48 / G query positions) over torch's threads, largest first.
    fp32 throughout (bf16 K/V widened on load, the output rounded once): within ``rtol=0,
    atol=5e-6`` of the float64 result in fp32, half a bf16 ulp in bf16 (the tests').

    Args:
        q: ``[T, Hq, D]`` fp32 or bf16 (Hq a multiple of Hkv).
        kv: the B sequences' paged K/V (contiguous caches of q's dtype, int32 tables and
            lengths), this chunk's already written.
        query_start_loc: ``[B + 1]`` int32 cumulative query lengths (from 0).
        scale: softmax scale.

    Returns:
        ``[T, Hq, D]`` in q's dtype.

    Raises:
        RuntimeError: no AVX-512 here or a shape it does not take
            (:func:`prefill_attention_supported`), wrong dtypes, a chunk longer than its
            context, a context past its block table or a block id outside the cache.
    """
    return torch.ops.prefixgate_cpu.prefill_attention(
        q,
        kv.k_cache,
        kv.v_cache,
        kv.block_tables,
        query_start_loc,
        kv.context_lens,
        scale,
    )


_one_row_generation = 0


def one_row_changed() -> None:
    """Note that some layer's one-row GEMM (its kind or its copy of the weight) or a model's
    modules changed: callers that cached :data:`LinearSpec` s (``DecoderLayer``) rebuild them."""
    global _one_row_generation
    _one_row_generation += 1


def one_row_generation() -> int:
    """Bumped by every :func:`one_row_changed`; a cache of specs is valid while it is equal."""
    return _one_row_generation


LINEAR_KINDS = {
    "gemv": 0,
    "mm_t": 1,
    "linear": 2,
    "int8_gemv": 3,
    "int8_gemv16": 4,
    "int8_gemv8": 5,
    "onednn": 6,
}
"""One-row linear kinds :func:`decode_layer` runs → its code: fp32 panels (:func:`gemv` on
:func:`pack_panels`), ``torch.mm`` / ``torch.addmm`` on the ``[I, O]`` weight, ``F.linear`` on
``[O, I]``, :func:`gemv_int8` with fp32 / int16 / int8 activations on its packed weight, and
oneDNN's ``torch.ops.mkldnn._linear_pointwise`` on its packed (opaque) weight."""

DecodeAttentionArgs = tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    int,
    int,
    float,
]
"""The arguments of :func:`decode_attention` after ``qkv``: positions, cos/sin table, k and v
caches, block table, context length, slot, head counts and softmax scale."""

LinearSpec = tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]
"""``(LINEAR_KINDS code, weight as the kind takes it, int8 scale or None, bias or None,
out_features)``: what a linear module's ``one_row_spec()`` hands :func:`layer_linears`."""

LayerLinears = tuple[
    list[int], list[torch.Tensor], list[torch.Tensor | None], list[torch.Tensor | None], list[int]
]
"""A layer's four :data:`LinearSpec` s column by column (codes, weights, scales, biases,
out_features), as :func:`decode_layer`'s op takes them: built once by :func:`layer_linears`."""


def layer_linears(
    specs: tuple[LinearSpec, LinearSpec, LinearSpec, LinearSpec],
) -> LayerLinears:
    """The :data:`LayerLinears` of the qkv, o, gate_up and down specs, in that order."""
    return (
        [spec[0] for spec in specs],
        [spec[1] for spec in specs],
        [spec[2] for spec in specs],
        [spec[3] for spec in specs],
        [spec[4] for spec in specs],
    )


def decode_layer(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    input_norm: torch.Tensor,
    post_norm: torch.Tensor,
    eps: float,
    linears: LayerLinears,
    *attention: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pre-norm decoder layer (Llama: no q/k norm) for one decode token alone: ``(out, s)``
    with ``s = hidden + residual`` after the attention block (``hidden`` alone when
    ``residual`` is None, the first layer), ``out`` the MLP's ``[1, H]`` output; their sum is
    the layer's output, as ``DecoderLayer.forward`` returns it.

    Args:
        hidden, residual: ``[1, H]`` fp32.
        input_norm, post_norm: the two RMSNorm weights ``[H]`` fp32; eps: their epsilon.
        linears: :func:`layer_linears` of the qkv, o, gate_up and down specs.
        attention: :data:`DecodeAttentionArgs`, :func:`decode_attention`'s arguments after
            ``qkv`` (the caches written in place).

    Raises:
        RuntimeError: wrong dtypes, shapes, kinds or ranges (the ops' checks).
    """
    return torch.ops.prefixgate_cpu.decode_layer(
        hidden,
        residual,
        input_norm,
        post_norm,
        eps,
        *linears,
        *attention,
    )
