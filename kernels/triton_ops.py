"""The Triton backend: one entry point per kernel family, with the signatures and semantics of
:mod:`.torch_ref`, gathered for ``get_backend("triton")``.

Each family lives in its own module with its kernel, launcher and argument checks
(:mod:`.triton_checks`; bad arguments raise ``ValueError`` / ``TypeError`` before any launch):
paged KV writes :mod:`.triton_kv_cache`, decode attention :mod:`.triton_decode`, prefill
attention :mod:`.triton_prefill` (their shared online-softmax step: :mod:`.triton_attention`),
RMSNorm :mod:`.triton_norm`, rotary :mod:`.triton_rotary`, SwiGLU :mod:`.triton_activation`;
the int8 GEMM of quantized models is :mod:`.triton_int8`. On a machine without CUDA they run
in Triton's interpreter: :mod:`.triton_env` sets ``TRITON_INTERPRET=1`` before any kernel is
decorated, so ``attention_backend="triton"`` works on CPU tensors too (slowly; for tests).

Tolerances against the torch references (see ``tests/kernels``): fp32 about 1e-5 (different
summation order); fp16 about 2e-3 and bf16 about 2e-2 for attention (P is rounded to the
input dtype before the P·V dot, as in FlashAttention).
"""

from __future__ import annotations

# Re-exported by name (``import x as x``); ``prefixgate.kernels.KERNEL_NAMES`` lists them.
from prefixgate.kernels.triton_activation import silu_and_mul as silu_and_mul
from prefixgate.kernels.triton_decode import paged_attention_decode as paged_attention_decode
from prefixgate.kernels.triton_kv_cache import reshape_and_cache as reshape_and_cache
from prefixgate.kernels.triton_norm import rms_norm as rms_norm
from prefixgate.kernels.triton_prefill import paged_attention_prefill as paged_attention_prefill
from prefixgate.kernels.triton_prefill import paged_attention_verify as paged_attention_verify
from prefixgate.kernels.triton_rotary import rotary_embedding as rotary_embedding
