"""The GPU check script's dry run (tiny sizes, interpreter on CPU) writes its JSON report."""

from __future__ import annotations

import importlib
import json

import pytest


def _load():
    return importlib.import_module("examples.benchmarks.gpu_check")


def test_dry_run_writes_every_kernel_section(tmp_path):
    out = tmp_path / "gpu_check.json"
    rc = _load().main(["--dry-run", "--skip-engine", "--out", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0, report["errors"]
    for key in (
        "env",
        "correctness",
        "copy",
        "decode",
        "decode_smollm2_heads",
        "prefill",
        "prefill_with_prefix",
        "summary",
    ):
        assert key in report, key
    assert all(row["max_abs_err"] < 1e-4 for row in report["correctness"])
    assert report["decode"]["max_abs_err_vs_torch_ref"] < 1e-4
    assert report["prefill"]["sdpa"]["tflops"] > 0


@pytest.mark.slow
def test_dry_run_with_sweeps_and_engine(tmp_path):
    out = tmp_path / "gpu_check.json"
    rc = _load().main(["--dry-run", "--sweep", "--out", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0, report["errors"]
    for section in ("decode", "prefill"):
        sweep = report[section]["sweep"]
        assert sweep and all("error" not in row for row in sweep), sweep
    assert report["engine"]["triton"]["output_tokens"] > 0


def test_examples_launcher_runs_the_same_script(tmp_path):
    """``python examples/benchmarks/gpu_check.py`` is the package's script (arguments passed on)."""
    import subprocess
    import sys
    from pathlib import Path

    launcher = Path(__file__).parents[2] / "examples" / "benchmarks" / "gpu_check.py"
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, str(launcher), "--dry-run", "--skip-engine", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    assert "decode" in out.read_text()
