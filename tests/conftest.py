"""Shared fixtures: paths to ../shared test data (skipped when absent) and the block-pool check."""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
from pathlib import Path

import pytest
from prefixgate.sdk.bench.shared import shared_dir


def _register_examples() -> None:
    """Make ``examples`` (the benchmarks, ``examples.benchmarks.X``) importable without putting
    the checkout itself on ``sys.path``: there its ``kernels/`` would shadow HF's ``kernels``."""
    folder = Path(__file__).resolve().parents[1] / "examples"
    spec = importlib.util.spec_from_file_location(
        "examples", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["examples"] = module
    spec.loader.exec_module(module)


_register_examples()

SHARED = shared_dir()  # $PREFIXGATE_SHARED, else ./shared, ../shared, beside the checkout
AIDREAMS = SHARED / "models" / "aidreams-260k"
SMOLLM2_SHAPE = SHARED / "models" / "smollm2-135m-shape"
WORKLOADS = SHARED / "workloads"


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"test data {path} is absent (it lives in ../shared beside the checkout)")
    return path


@pytest.fixture(scope="session")
def aidreams_path() -> str:
    """The real trained tiny Llama; skips when ../shared is absent."""
    return str(_require(AIDREAMS / "model.safetensors").parent)


@pytest.fixture(scope="session")
def smollm2_shape_path() -> str:
    """Config + tokenizer of the 135 M SmolLM2 shape (no weights: load_format='dummy')."""
    return str(_require(SMOLLM2_SHAPE / "config.json").parent)


@pytest.fixture(scope="session")
def workloads_path() -> Path:
    """Real system prompts (CSV) and user tasks (JSONL)."""
    return _require(WORKLOADS / "system_prompts.csv").parent


def assert_pool_whole(obj, pinned_ok: bool = False) -> None:
    """Assert the KV block pool is whole: no request left, every block in exactly one state.

    ``obj`` is an ``LLM``, ``LLMEngine``, ``AsyncEngine`` or ``Scheduler``. Each must offer ``stats()`` and
    ``check_invariants()`` (which raises AssertionError on a block in two states or none).
    With ``pinned_ok`` blocks held by prefix pins may stay used.
    """
    obj.check_invariants()
    s = obj.stats()
    assert s["num_running"] == 0 and s["num_waiting"] == 0, s
    assert s["kv_blocks_used"] + s["kv_blocks_free"] == s["kv_blocks_total"], s
    if not pinned_ok:
        assert s["kv_blocks_used"] == 0, s


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PREFIXGATE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow test: set PREFIXGATE_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def pool_whole():
    """The block-pool check as a fixture: ``pool_whole(llm)`` (see ``assert_pool_whole``)."""
    return assert_pool_whole


@pytest.fixture(scope="module")
def one_thread():
    """One torch intra-op thread for a module's tests, restored after it (a module opts in
    with ``pytestmark = pytest.mark.usefixtures("one_thread")``): on a loaded 2-core machine
    torch's thread pool makes tiny-model steps ~25x slower (threads spin-wait on each other)."""
    import torch  # here, not at the top: the sdk tests run without torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_runtest_teardown(item, nextitem):
    """Between two test modules, collect what the first left unreferenced, with no event loop
    running: an ``AsyncOpenAI`` / ``AsyncAnthropic`` client left open closes itself when it is
    collected by scheduling its ``aclose`` on the loop running then, which fails whatever async
    test is running ("Event loop is closed": its connections belong to a loop that is gone).
    A whole-suite run on a loaded machine failed ``test_flow_control`` so, for a client an
    openai-agents test had left open."""
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        gc.collect()
