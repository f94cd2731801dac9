"""The checkout's top-level folders are ``prefixgate.*`` only, never top-level packages that
hide a distribution of the same name from a Python started in the checkout's root.

transformers 5 imports Hugging Face's ``kernels`` when a model loads; with the root first on
``sys.path`` (``python3 -m pytest``, ``python3 -c`` there) the folder ``kernels/`` used to shadow
it (``ImportError: cannot import name 'CUDAProperties' from 'kernels'``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("sdk", "gateway", "engine", "kernels")


def _run_in_root(code: str) -> subprocess.CompletedProcess[str]:
    """``python -c code`` with the checkout's root as the working directory, so ``sys.path[0]``
    is the root, as for a new user's ``python3 -m pytest`` or ``python3 -c`` there."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240
    )


@pytest.mark.parametrize("folder", FOLDERS)
def test_bare_folder_name_is_not_the_checkout(folder: str) -> None:
    out = _run_in_root(
        "import sys\n"
        f"assert sys.path[0] in ('', {str(ROOT)!r}), sys.path[:2]\n"
        "try:\n"
        f"    import {folder} as m\n"
        "except ModuleNotFoundError as e:\n"
        "    print('absent', e.name)\n"
        "else:\n"
        "    print('found', m.__file__)\n"
    )
    assert out.returncode == 0, out.stderr
    kind, where = out.stdout.split(maxsplit=1)
    # Either another distribution owns the name or nothing does; never the checkout's folder.
    assert not where.strip().startswith(str(ROOT / folder)), out.stdout
    assert kind == "absent" or Path(where.strip()).is_file()


def test_prefixgate_parts_import_beside_bare_names() -> None:
    out = _run_in_root(
        "import prefixgate.kernels, prefixgate.engine, prefixgate.sdk, prefixgate.gateway\n"
        "print(prefixgate.kernels.get_backend('torch').rms_norm.__module__)\n"
        "print(prefixgate.engine.SamplingParams.__module__, prefixgate.sdk.AsyncClient.__name__)\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        "prefixgate.kernels.torch_ref",
        "prefixgate.engine.sampling_params",
        "AsyncClient",
    ]


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)
def test_transformers_loads_the_reference_model_from_the_root(aidreams_path: str) -> None:
    """With Hugging Face's ``kernels`` installed (transformers 5 pulls it in), transformers
    imports it from the root and loads the reference model."""
    out = _run_in_root(
        "import importlib.util\n"
        "from transformers import AutoModelForCausalLM\n"
        "from transformers.utils import import_utils\n"
        "usable = getattr(import_utils, 'is_kernels_available', lambda: False)\n"
        "if importlib.util.find_spec('kernels') is not None and usable():\n"
        "    import transformers.integrations.hub_kernels  # the integration that imports it\n"
        "    from kernels import get_kernel  # the distribution's own name\n"
        "    print('kernels', get_kernel.__module__)\n"
        f"m = AutoModelForCausalLM.from_pretrained({aidreams_path!r})\n"
        "print('loaded', type(m).__name__)\n"
    )
    assert out.returncode == 0, out.stderr
    assert "loaded LlamaForCausalLM" in out.stdout
    if "kernels" in out.stdout.split():
        assert not out.stdout.split()[1].startswith("prefixgate")
