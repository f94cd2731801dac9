"""Decode CUDA graphs (``cuda_graphs=True``): start-up checks, capture sizes, and the static
buffer / padding logic run on CPU with an eager stand-in for the captured graph.

The stand-in replays the model eagerly on the graph's static buffers and padded batch, so every
part but the capture itself (padding rows with slot -1, context length 1, zeroed table columns,
reading the first B rows) is checked for greedy equality with the plain engine. The capture runs
on a GPU in ``python -m examples.benchmarks.gpu_check`` (section ``engine_variants``).
"""

from __future__ import annotations

import pytest
from prefixgate.engine import LLM, SamplingParams
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.cuda_graphs import DecodeCudaGraphs, capture_sizes, check_cuda_graphs

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_refused_where_it_cannot_work():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        LLM(None, cuda_graphs=True, device="cpu")
    with pytest.raises(ValueError, match="attention_backend='triton'"):
        check_cuda_graphs(True, "cuda", "torch")
    check_cuda_graphs(True, "cuda", None)  # triton by default on CUDA
    check_cuda_graphs(False, "cpu", "torch")
    with pytest.raises(TypeError, match="cuda_graphs must be a bool"):
        EngineConfig(cuda_graphs="yes")


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(30) == [1, 2, 4, 8, 16, 24, 30]


class _EagerGraph:
    def __init__(self, owner: DecodeCudaGraphs, size: int) -> None:
        self.owner, self.size = owner, size

    def replay(self) -> None:
        o = self.owner
        args = (o.input_ids[: self.size], o.positions[: self.size], o.kv_caches)
        o.outputs[self.size] = o.model(*args, o._meta(self.size))


class EagerStandIn(DecodeCudaGraphs):
    """``DecodeCudaGraphs`` whose "graph" reruns the model on the static buffers."""

    captured: list[int]

    def _capture(self, size: int) -> None:
        self.captured = [*getattr(self, "captured", []), size]
        self.graphs[size] = _EagerGraph(self, size)


def test_padded_static_buffers_give_the_eager_tokens(aidreams_path, pool_whole):
    prompts = ["Once upon a time", "The cat", "Lily and Ben went", "One day a", "Tom had"]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    plain = LLM(str(aidreams_path), dtype="float32", device="cpu", max_num_seqs=8)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]

    llm = LLM(str(aidreams_path), dtype="float32", device="cpu", max_num_seqs=8)
    eng = llm.engine
    width = -(-eng.max_model_len // eng.config.block_size)
    graphs = EagerStandIn(
        eng.runner.model, eng.runner.kv_caches, 8, width, eng.config.block_size, "cpu"
    )
    eng.runner.cuda_graphs = graphs
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    assert 8 in graphs.captured  # 5 decodes padded to 8
    pool_whole(llm)
    pool_whole(plain)
