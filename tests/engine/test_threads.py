"""The engine's thread policy: ``EngineConfig.threads`` applied once before the model is built."""

from __future__ import annotations

import pytest
import torch
from prefixgate.engine import LLM
from prefixgate.engine.threads import (
    MAX_DEFAULT_THREADS,
    apply_threads,
    available_cpus,
    default_threads,
)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_default_is_the_affinity_mask_capped():
    import os

    mask = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert available_cpus() == mask
    assert default_threads() == min(mask, MAX_DEFAULT_THREADS) >= 1


def test_apply_threads(restore_threads):
    torch.set_num_threads(2)
    apply_threads(None)
    assert torch.get_num_threads() == 2
    apply_threads(1)
    assert torch.get_num_threads() == 1
    with pytest.raises(ValueError):
        apply_threads(0)


def test_engine_sets_its_threads_before_the_model(restore_threads):
    torch.set_num_threads(2)
    llm = LLM(None, load_format="dummy", threads=1, num_kv_blocks=16)
    assert torch.get_num_threads() == 1
    assert llm.config.threads == 1
