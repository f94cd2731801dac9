"""The pooling runner (``runner="pooling"``): embeddings equal transformers' pooled hidden
states (``AutoModel``'s ``last_hidden_state``, last-token or mean pooling, L2-normalized) on
tiny random Llama and Qwen3 checkpoints, fp32; and the same over HTTP with the official
openai client (``client.embeddings.create``, float and base64)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: make model_helpers importable
from model_helpers import tiny_hf_model  # noqa: E402
from prefixgate.engine import EngineConfig  # noqa: E402
from prefixgate.engine.pooling import PoolingEngine  # noqa: E402

TOL = 1e-4  # fp32, max abs difference of unit vectors


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _checkpoint(kind: str, out: Path, aidreams_path: str):
    """A tiny random checkpoint of ``kind`` with aidreams-260k's tokenizer files (vocab 512,
    the checkpoint's vocab set to match): the engine loads a model folder's tokenizer."""
    hf = tiny_hf_model(kind, out, vocab_size=512)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(aidreams_path) / name, out / name)
    return hf


def _engine(path: Path, pooling: str = "last", **kw) -> PoolingEngine:
    cfg = EngineConfig(
        model=str(path), dtype="float32", device="cpu", runner="pooling", pooling_type=pooling, **kw
    )
    return PoolingEngine(cfg)


def _reference(hf, inputs: list[list[int]], pooling: str) -> torch.Tensor:
    rows = []
    with torch.no_grad():
        for ids in inputs:
            h = hf.model(torch.tensor([ids])).last_hidden_state[0].float()
            rows.append(h[-1] if pooling == "last" else h.mean(0))
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1)


INPUTS = [[5, 9, 33, 7], [100], list(range(3, 70)), [250, 4, 4, 4, 4, 17, 18, 19, 2]]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_match_transformers(tmp_path, aidreams_path, kind, pooling):
    hf = _checkpoint(kind, tmp_path, aidreams_path)
    engine = _engine(tmp_path, pooling, max_num_batched_tokens=80)
    got = torch.tensor(engine.embed(INPUTS))
    want = _reference(hf, INPUTS, pooling)
    assert got.shape == (len(INPUTS), hf.config.hidden_size)
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(INPUTS)), atol=1e-5)
    assert (got - want).abs().max().item() < TOL
    # batching does not change a vector: one at a time == all at once
    alone = torch.tensor([engine.embed([x])[0] for x in INPUTS])
    assert (alone - got).abs().max().item() < TOL


def test_bad_inputs_are_value_errors(tmp_path, aidreams_path):
    _checkpoint("llama", tmp_path, aidreams_path)
    engine = _engine(tmp_path, "last")
    for bad in ([[]], [[1, 10**6]], [[-1]], [list(range(300))]):
        with pytest.raises(ValueError):
            engine.embed(bad)
    assert len(engine.embed([[1, 2, 3]])[0]) == 64  # still serving


def test_generation_refused_on_a_pooling_runner(tmp_path, aidreams_path):
    import asyncio

    from prefixgate.engine.protocol import EngineRequest
    from prefixgate.engine.sampling_params import SamplingParams

    _checkpoint("llama", tmp_path, aidreams_path)
    engine = _engine(tmp_path, "last")

    async def go():
        async for _ in engine.generate(EngineRequest("r", [1, 2], SamplingParams(max_tokens=2))):
            pass

    with pytest.raises(ValueError, match="embedding model"):
        asyncio.run(go())
