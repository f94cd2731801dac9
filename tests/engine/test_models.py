"""Logits of our paged-KV model equal transformers' (fp32, max abs diff < 1e-4)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: make model_helpers importable
from model_helpers import PagedRunner, load, tiny_hf_model  # noqa: E402

TOL = 1e-4  # fp32 max abs logit difference vs transformers (eager attention)
KINDS = [
    "llama",
    "llama_tied",
    "llama_bias",
    "llama3_rope",
    "llama_linear_rope",
    "mistral",
    "qwen2",
    "qwen3",
]


def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_chunks_and_decode_match_transformers(kind, tmp_path):
    hf = tiny_hf_model(kind, tmp_path)
    model = load(tmp_path)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 320, (40,), generator=gen).tolist()
    ref = _hf_logits(hf, ids)  # [40, V]

    runner = PagedRunner(model, block_size=4)
    got = [runner.step([("a", ids[:13])])[0]]  # chunked prefill: 13 tokens, then 17
    got.append(runner.step([("a", ids[13:30])])[0])
    for t in range(30, 40):  # decode steps through the paged cache
        got.append(runner.step([("a", [ids[t]])])[0])
    positions = [12, 29, *range(30, 40)]
    diff = (torch.stack(got) - ref[positions]).abs().max().item()
    assert diff < TOL, f"{kind}: max abs logit diff {diff}"


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_mixed_batch_decodes_and_prefills(kind, tmp_path):
    """Decodes of two sequences and prefill chunks of two others share one forward."""
    hf = tiny_hf_model(kind, tmp_path)
    model = load(tmp_path)
    gen = torch.Generator().manual_seed(2)
    seqs = {
        s: torch.randint(3, 320, (n,), generator=gen).tolist()
        for s, n in [("a", 20), ("b", 9), ("c", 31), ("d", 5)]
    }
    refs = {s: _hf_logits(hf, ids) for s, ids in seqs.items()}
    runner = PagedRunner(model, block_size=8, num_blocks=32)
    runner.step([("a", seqs["a"][:19]), ("b", seqs["b"][:8])])
    # a, b decode; c prefills its first chunk; d its whole prompt.
    out = runner.step(
        [("c", seqs["c"][:17]), ("a", seqs["a"][19:]), ("d", seqs["d"]), ("b", seqs["b"][8:])]
    )
    expect = torch.stack([refs["c"][16], refs["a"][19], refs["d"][4], refs["b"][8]])
    assert (out - expect).abs().max().item() < TOL
    out = runner.step([("c", seqs["c"][17:])])
    assert (out[0] - refs["c"][30]).abs().max().item() < TOL


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_close_to_fp32(tmp_path, dtype):
    """bf16 / fp16 weights, activations and KV cache: logits within a loose bound of fp32."""
    tiny_hf_model("llama", tmp_path)
    ids = list(range(3, 30))
    f32 = PagedRunner(load(tmp_path)).step([("a", ids)])
    half = PagedRunner(load(tmp_path, dtype=dtype)).step([("a", ids)])
    assert half.dtype == torch.float32
    assert (half - f32).abs().max().item() < 0.1


def test_tiny_random_preset_runs():
    model = load(None)
    cfg = model.config
    assert cfg.preset == "tiny-random" and cfg.vocab_size == 354 and cfg.max_model_len == 2048
    runner = PagedRunner(model, block_size=16)
    logits = runner.step([("a", [1, 40, 41, 42]), ("b", [1, 50])])
    assert logits.shape == (2, 354) and torch.isfinite(logits).all()
    again = PagedRunner(load(None)).step([("a", [1, 40, 41, 42]), ("b", [1, 50])])
    assert torch.equal(logits, again)  # seeded dummy weights: same every load
    alone = PagedRunner(load(None)).step([("a", [1, 40, 41, 42])])
    # Not bitwise batch-invariant (GEMM blocking depends on the batch), but fp32-close.
    assert (alone[0] - logits[0]).abs().max().item() < 1e-5


def test_aidreams_greedy_equals_transformers_generate(aidreams_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(aidreams_path)
    hf = AutoModelForCausalLM.from_pretrained(aidreams_path, dtype=torch.float32).eval()
    prompts = [
        "I sense the nodes",
        "Once upon a time",
        "The light",
        "You dream.\n\nI am",
        "Silent circuits hum and",
    ]
    new = 40
    model = load(aidreams_path)
    runner = PagedRunner(model, block_size=16, num_blocks=64)
    prompt_ids = [hf_tok(p).input_ids for p in prompts]
    logits = runner.step([(i, ids) for i, ids in enumerate(prompt_ids)])  # 5 prefills at once
    outs: list[list[int]] = [[] for _ in prompts]
    for _ in range(new):
        nxt = logits.argmax(-1).tolist()
        for i, t in enumerate(nxt):
            outs[i].append(t)
        logits = runner.step([(i, [t]) for i, t in enumerate(nxt)])  # 5 decodes
    for i, ids in enumerate(prompt_ids):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
        assert outs[i] == ref, (prompts[i], hf_tok.decode(outs[i]), hf_tok.decode(ref))
