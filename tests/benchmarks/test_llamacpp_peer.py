"""The llama.cpp peer benchmark's parts that need no llama.cpp: the GGUF it writes (read back
with the ``gguf`` package's reader), the one-line skip when no llama.cpp is installed, the table."""

from __future__ import annotations

import json
import shutil

import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package (the bench extra) is not installed")

from prefixgate.sdk.bench.shared import shared_dir  # noqa: E402

from examples.benchmarks import llamacpp_peer  # noqa: E402

SMOL = shared_dir() / "models" / "smollm2-135m-shape"


@pytest.fixture
def tiny_model(tmp_path):
    if not (SMOL / "tokenizer.json").exists():
        pytest.skip(f"{SMOL} is absent (../shared)")
    cfg = json.loads((SMOL / "config.json").read_text())
    cfg.update(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        head_dim=32,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    shutil.copy(SMOL / "tokenizer.json", tmp_path / "m" / "tokenizer.json")
    return tmp_path / "m", cfg


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_the_gguf_holds_the_models_shape_and_tokenizer(tiny_model, tmp_path, kind):
    model, cfg = tiny_model
    path = llamacpp_peer.write_gguf(model, tmp_path / f"m-{kind}.gguf", kind)
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    # embeddings, final norm, and 9 per layer; tied embeddings: no output.weight
    assert len(tensors) == 2 + 9 * cfg["num_hidden_layers"]
    assert "output.weight" not in tensors
    q = tensors["blk.1.attn_q.weight"]
    want = "Q8_0" if kind == "q8_0" else "F32"
    assert q.tensor_type.name == want
    assert tensors["blk.1.attn_norm.weight"].tensor_type.name == "F32"  # norms stay f32
    assert [int(d) for d in tensors["blk.0.attn_k.weight"].shape] == [64, 32]  # (in, out)
    fields = reader.fields
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == cfg["vocab_size"]
    assert int(fields["llama.block_count"].parts[-1][0]) == cfg["num_hidden_layers"]
    assert int(fields["llama.attention.head_count_kv"].parts[-1][0]) == 1


def test_an_unknown_kind_is_refused(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="kind"):
        llamacpp_peer.write_gguf(tiny_model[0], tmp_path / "x.gguf", "q4")


def test_no_llamacpp_installed_means_no_peer_command(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_llama(name, *args, **kwargs):
        if name.startswith("llama_cpp"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(llamacpp_peer.shutil, "which", lambda _name: None)
    monkeypatch.setattr(llamacpp_peer.Path, "home", classmethod(lambda cls: tmp_path))
    monkeypatch.setattr(builtins, "__import__", no_llama)
    assert llamacpp_peer.llamacpp_command(tmp_path / "m.gguf", 1234, 2, 2048) is None
    monkeypatch.setattr(llamacpp_peer.shutil, "which", lambda _name: "/usr/bin/llama-server")
    cmd = llamacpp_peer.llamacpp_command(tmp_path / "m.gguf", 1234, 2, 2048)
    assert cmd is not None and cmd[0] == "/usr/bin/llama-server" and "-t" in cmd


def test_llama_server_serves_parallel_slots_with_the_context_of_each(monkeypatch, tmp_path):
    built = tmp_path / ".cache" / "prefixgate" / "llama.cpp-0.3.36" / "bin" / "llama-server"
    built.parent.mkdir(parents=True)
    built.touch()
    monkeypatch.setattr(llamacpp_peer.shutil, "which", lambda _name: None)
    monkeypatch.setattr(llamacpp_peer.Path, "home", classmethod(lambda cls: tmp_path))
    cmd = llamacpp_peer.llamacpp_command(tmp_path / "m.gguf", 1234, 2, 1344, slots=32)
    assert cmd is not None and cmd[0] == str(built)
    assert cmd[cmd.index("--parallel") + 1] == "32" and cmd[cmd.index("-c") + 1] == str(32 * 1344)
    assert "--cont-batching" in cmd and "--no-repack" not in cmd
    q8 = llamacpp_peer.llamacpp_command(tmp_path / "m.gguf", 1234, 2, 1344, repack=False)
    assert q8 is not None and "--no-repack" in q8 and q8[q8.index("--parallel") + 1] == "1"


def test_the_table_gives_medians_spreads_and_the_ratio():
    results = {
        "prefixgate": {"batched": [10, 20, 30], "prefill": [1.0], "warm": [1.5], "decode": [40.0]},
        "llama.cpp": {"batched": [10, 10, 10], "prefill": [2.0], "warm": [2.0], "decode": [20.0]},
    }
    text = llamacpp_peer.table(results)
    assert "| batched output tok/s | 20 (10–30) | 10 (10–10) | 2.00× |" in text
    assert "| single-stream decode tok/s | 40 (40–40) | 20 (20–20) | 2.00× |" in text


def test_the_table_leaves_out_rows_not_measured():
    # --single-only fills the decode row alone
    empty = {"batched": [], "prefill": [], "warm": []}
    results = {
        "prefixgate": {**empty, "decode": [30.0, 40.0, 50.0]},
        "llama.cpp": {**empty, "decode": [20.0]},
    }
    text = llamacpp_peer.table(results)
    assert "| single-stream decode tok/s | 40 (30–50) | 20 (20–20) | 2.00× |" in text
    assert "batched" not in text and "prefill" not in text and "warm" not in text
