"""``triton_ops`` switches to the interpreter by itself on CPU, even after triton was imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

_SCRIPT = textwrap.dedent("""
    import torch
    import torch._dynamo  # imports triton in compiled mode, before the kernels set the flag
    import sys
    assert "triton" in sys.modules
    from prefixgate.kernels import get_backend, torch_ref
    from prefixgate.kernels.paged import PagedKV
    ops = get_backend("triton")
    x, w, r = torch.randn(3, 64), torch.randn(64), torch.randn(3, 64)
    out, res = ops.rms_norm(x, w, 1e-5, r)
    ref, ref_res = torch_ref.rms_norm(x, w, 1e-5, r)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    q, kc, vc = torch.randn(2, 4, 32), torch.randn(4, 16, 2, 32), torch.randn(4, 16, 2, 32)
    bt, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([20, 7], dtype=torch.int32)
    kv = PagedKV(kc, vc, bt, lens)
    torch.testing.assert_close(ops.paged_attention_decode(q, kv, 0.2),
                               torch_ref.paged_attention_decode(q, kv, 0.2), atol=1e-5, rtol=0)
    print("ok")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_triton_backend_works_on_cpu_after_triton_was_imported():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=240, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
