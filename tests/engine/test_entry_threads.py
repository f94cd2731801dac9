"""Every entry point ends up with OpenMP's bounded spinning, or a safe thread count where it
cannot: each case is a fresh process with a clean environment (OpenMP reads its settings once,
when torch loads). What libgomp really runs with is read from its own report
(``OMP_DISPLAY_ENV=verbose`` prints ``GOMP_SPINCOUNT`` at load: 30,000 for the engine's bounded
spinning, 0 for passive waiting, 300,000 for its default), not from our variables.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# run as a file: the checkout (examples' parent) is not put on sys.path, see run()
THREADS_BENCH = Path(__file__).resolve().parents[2] / "examples" / "benchmarks" / "threads.py"

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="GNU libgomp's report: Linux")


def run(code: str, aidreams: str, **env_extra: str) -> tuple[dict, str, str]:
    """Run ``code`` in a fresh interpreter with no wait variables set; returns (the JSON of its
    last stdout line, libgomp's GOMP_SPINCOUNT, stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME")}
    env.pop("GOMP_SPINCOUNT", None)
    env.pop("OMP_NUM_THREADS", None)
    env.update(OMP_DISPLAY_ENV="verbose", AIDREAMS=aidreams, **env_extra)
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(aidreams),  # not the checkout: its kernels/ would shadow HF's
    )
    assert out.returncode == 0, out.stderr[-3000:]
    spin = re.search(r"GOMP_SPINCOUNT = '(\d+)'", out.stderr)
    assert spin is not None, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), spin.group(1), out.stderr


BOUNDED = {"GOMP_SPINCOUNT": "30000", "KMP_BLOCKTIME": "1"}
"""What the engine's import and ``prefixgate serve`` set (engine/threads.py)."""

PRINT = (
    "from prefixgate.engine import threads; import torch, json; "
    "s = threads.openmp_settings(); s['before'] = before; print(json.dumps(s))"
)


def test_llm_gets_bounded_spinning_and_keeps_torchs_threads(aidreams_path):
    code = (
        "import os\n"
        "from prefixgate.engine import LLM\n"
        "import torch\n"
        "before = torch.get_num_threads()\n"
        "LLM(os.environ['AIDREAMS'], num_kv_blocks=16)\n" + PRINT
    )
    got, spin, _ = run(code, aidreams_path)
    assert spin == "30000"  # libgomp spins a bounded while, then sleeps
    assert got["environ"] == BOUNDED
    assert not got["waits_actively"]
    assert got["torch_threads"] == got["before"]  # torch's own default, untouched


@pytest.mark.parametrize(
    "code",
    [
        "import asyncio, os\n"
        "from prefixgate.engine import AsyncEngine\n"
        "import torch\n"
        "before = torch.get_num_threads()\n"
        "async def main():\n"
        "    e = AsyncEngine(model=os.environ['AIDREAMS'], num_kv_blocks=16)\n"
        "    await e.shutdown()\n"
        "asyncio.run(main())\n" + PRINT,
        "from prefixgate.gateway import cli\n"
        "try:\n"
        "    cli.main(['serve', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "import torch\n"
        "before = torch.get_num_threads()\n" + PRINT,
    ],
    ids=["async_engine", "serve"],
)
def test_entry_gets_bounded_spinning_and_keeps_torchs_threads(aidreams_path, code):
    got, spin, _ = run(code, aidreams_path)
    assert spin == "30000" and not got["waits_actively"]
    assert got["torch_threads"] == got["before"]


def test_engine_bench_gets_bounded_spinning(aidreams_path):
    code = (
        "import runpy, sys\n"
        "sys.argv = ['threads', '--settings']\n"
        f"runpy.run_path({str(THREADS_BENCH)!r}, run_name='__main__')\n"
    )
    got, spin, _ = run(code, aidreams_path)
    assert spin == "30000"
    assert got["environ"] == BOUNDED


def test_every_benchmark_gets_bounded_spinning_whatever_it_imports_first(aidreams_path):
    """``python -m examples.benchmarks.NAME`` imports the package first, which imports the
    engine (torch-free) before the benchmark's own ``import torch`` (one_row_ops imports torch
    at its top)."""
    root = str(THREADS_BENCH.parents[2])
    code = (
        f"import sys; sys.path.insert(0, {root!r})\n"
        "import examples.benchmarks.one_row_ops\n"
        "import torch\n"
        "before = torch.get_num_threads()\n" + PRINT
    )
    got, spin, _ = run(code, aidreams_path)
    assert spin == "30000" and got["environ"] == BOUNDED


def test_the_threads_benchs_api_measurement_runs_as_a_user_program_does(aidreams_path):
    """``threads --policies api`` measures what ``LLM`` gets in a program that imports the
    engine first: its measuring child once imported torch first and so measured OpenMP's
    default spinning under the name ``api`` (1.69 tok/s beside a busy process, 0.05x quiet,
    on a Xeon)."""
    code = (
        "import os, runpy, sys\n"
        "sys.argv = ['threads', '--child', '--threads', '2', '--model', os.environ['AIDREAMS'],\n"
        "            '--max-tokens', '2', '--prompt-len', '4', '--trials', '1']\n"
        f"runpy.run_path({str(THREADS_BENCH)!r}, run_name='__main__')\n"
    )
    got, spin, err = run(code, aidreams_path)
    assert spin == "30000", err[-2000:]  # libgomp's bounded spinning, not its default
    assert got["tok_s"] > 0


# the user's program imports torch (and sets its threads) before it builds the engine
TORCH_FIRST = (
    "import os, torch\n"
    "torch.set_num_threads(2)\n"
    "before = torch.get_num_threads()\n"
    "from prefixgate.engine import LLM\n"
    "LLM(os.environ['AIDREAMS'], num_kv_blocks=16)\n" + PRINT
)


def test_torch_imported_first_runs_one_thread_and_says_why(aidreams_path):
    got, spin, err = run(TORCH_FIRST, aidreams_path)
    assert spin == "300000"  # too late: libgomp kept its default
    assert got["waits_actively"] and got["engine_import"]["torch_first"]
    assert got["environ"] == {}  # nothing set that OpenMP would not read
    assert got["torch_threads"] == 1
    assert "torch was imported before prefixgate.engine" in err


def test_torch_first_with_an_explicit_thread_count_keeps_it_and_warns(aidreams_path):
    code = (
        "import os, torch\n"
        "before = torch.get_num_threads()\n"
        "from prefixgate.engine import LLM\n"
        "LLM(os.environ['AIDREAMS'], num_kv_blocks=16, threads=2)\n" + PRINT
    )
    got, spin, err = run(code, aidreams_path)
    assert spin == "300000" and got["torch_threads"] == 2
    assert "2 threads as asked" in err


def test_torch_first_with_the_users_policy_is_left_alone(aidreams_path):
    got, spin, err = run(TORCH_FIRST, aidreams_path, OMP_WAIT_POLICY="PASSIVE")
    assert spin == "0" and not got["waits_actively"]
    assert got["torch_threads"] == 2
    assert "torch was imported before" not in err
