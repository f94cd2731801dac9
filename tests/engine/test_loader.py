"""ModelConfig and load_model: config parsing, sharded checkpoints, dummy weights, clear errors."""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.models import ModelConfig, ModelFileNotFoundError, load_model
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: make model_helpers importable
from model_helpers import PagedRunner, load, tiny_hf_model  # noqa: E402


def model_config(path, **fields) -> ModelConfig:
    return ModelConfig.from_engine_config(EngineConfig(model=str(path), device="cpu", **fields))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    tiny_hf_model("llama", path)
    return path


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _shape(cfg) -> tuple[int, ...]:
    """hidden size, layers, query heads, KV heads, head dim, intermediate size, vocabulary."""
    return (
        cfg.hidden_size,
        cfg.num_layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
    )


def test_config_fields(llama_dir):
    cfg = model_config(llama_dir)
    assert (cfg.architecture, *_shape(cfg)) == ("LlamaForCausalLM", 64, 2, 4, 2, 16, 96, 320)
    assert cfg.max_model_len == 256 and cfg.eos_token_ids == {2} and cfg.bos_token_id == 1
    assert cfg.dtype == torch.float32 and cfg.device == "cpu" and not cfg.tie_word_embeddings
    assert model_config(llama_dir, max_model_len=100).max_model_len == 100
    assert model_config(llama_dir, dtype="bfloat16").dtype == torch.bfloat16
    over = model_config(llama_dir, hf_overrides={"num_hidden_layers": 1})
    assert over.num_layers == 1


def test_aidreams_config(aidreams_path):
    cfg = model_config(aidreams_path)
    assert cfg.max_model_len == 128 and cfg.tie_word_embeddings and cfg.head_dim == 16
    assert cfg.eos_token_ids == {2} and cfg.rope_theta == 10000.0 and cfg.rope_scaling is None


def test_smollm2_shape_dummy_config(smollm2_shape_path):
    cfg = model_config(smollm2_shape_path, load_format="dummy")
    assert (*_shape(cfg), cfg.rope_theta) == (576, 30, 9, 3, 64, 1536, 49152, 100000.0)


def test_max_model_len_above_the_model_limit(llama_dir):
    with pytest.raises(ValueError, match="max_model_len 257 exceeds"):
        model_config(llama_dir, max_model_len=257)


def test_legacy_rope_keys_and_generation_eos(tmp_path, llama_dir):
    path = copy(llama_dir, tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw["rope_theta"] = 5e5
    raw["rope_scaling"] = {
        "type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    raw["torch_dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(raw))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    cfg = model_config(path)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.eos_token_ids == {2, 7} and cfg.dtype == torch.bfloat16  # dtype "auto"


def test_unsupported_architecture_names_it_and_the_list(tmp_path, llama_dir):
    path = copy(llama_dir, tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        model_config(path)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(ModelFileNotFoundError, match="does not exist"):
        model_config(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="config.json"):  # also a ValueError
        model_config(tmp_path)


def test_missing_weights_file(tmp_path, llama_dir):
    path = copy(llama_dir, tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelFileNotFoundError, match="model.safetensors"):
        load(path)


def test_missing_tensor_is_named(tmp_path, llama_dir):
    path = copy(llama_dir, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"missing tensor model\.layers\.1\.self_attn\.k_proj\.weight"
    ):
        load(path)


def test_unexpected_shape_names_tensor_and_file(tmp_path, llama_dir):
    path = copy(llama_dir, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(95, 64)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.0\.mlp\.up_proj\.weight in .*model\.safetensors has shape \(95, 64\)",
    ):
        load(path)


def test_sharded_checkpoint_loads_the_same(tmp_path, llama_dir):
    hf = tiny_hf_model("llama", tmp_path / "sharded")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    (tmp_path / "sharded" / "model.safetensors").unlink(missing_ok=True)
    ids = list(range(3, 20))
    a = PagedRunner(load(tmp_path / "sharded")).step([("a", ids)])
    b = PagedRunner(load(llama_dir)).step([("a", ids)])
    assert torch.equal(a, b)
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelFileNotFoundError, match=shard.name):
        load(tmp_path / "sharded")


def test_dummy_weights_are_seeded_and_logged(llama_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="prefixgate.engine.models.loader"):
        a = load(llama_dir, load_format="dummy", seed=1)
    assert "dummy random weights" in caplog.text
    b = load(llama_dir, load_format="dummy", seed=1)
    c = load(llama_dir, load_format="dummy", seed=2)
    wa, wb, wc = (m.model.layers[0].self_attn.qkv_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_preset_by_name_and_default():
    cfg = ModelConfig.from_engine_config(EngineConfig(model="tiny-random", device="cpu"))
    assert cfg.preset == "tiny-random" and cfg.model_path is None
    model = load_model(cfg, EngineConfig(device="cpu"))
    assert not model.training and all(not p.requires_grad for p in model.parameters())


def test_mistral_sliding_window_caps_max_model_len(tmp_path):
    tiny_hf_model("mistral", tmp_path, sliding_window=64)
    assert model_config(tmp_path).max_model_len == 64  # no sliding-window attention: stay exact
    with pytest.raises(ValueError, match="exceeds"):
        model_config(tmp_path, max_model_len=65)


def test_unsupported_rope_type(tmp_path, llama_dir):
    path = copy(llama_dir, tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="yarn"):
        model_config(path)
