"""The SDK imports without torch, the engine or the gateway."""

from __future__ import annotations

from support.fresh_process import run_code


def test_sdk_imports_without_torch() -> None:
    code = (
        "import sys\n"
        "for name in ('torch', 'triton', 'transformers', 'aiohttp', 'numpy',\n"
        "             'prefixgate.engine', 'prefixgate.gateway', 'prefixgate.kernels'):\n"
        "    sys.modules[name] = None  # any import of these raises ImportError\n"
        "import prefixgate.sdk as sdk\n"
        "from prefixgate.sdk import AsyncClient, Client\n"
        "c = AsyncClient('http://127.0.0.1:9/v1')\n"
        "print(sorted(m for m, v in sys.modules.items() if v is not None and m.startswith('prefixgate')))\n"
    )
    stdout = run_code(code, timeout_s=60)
    assert "prefixgate.engine'" not in stdout and "prefixgate.gateway'" not in stdout
