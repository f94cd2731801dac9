"""Reading Hugging Face safetensors checkpoints (single file or sharded index)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from prefixgate.engine.models.errors import ModelFileNotFoundError
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: ``model.safetensors`` or the shards named by
    ``model.safetensors.index.json``'s ``weight_map``.

    Raises:
        ModelFileNotFoundError: neither file exists, or a shard named by the index is missing.
        ValueError: the index is not valid JSON or has no ``weight_map``.
    """
    root = Path(model_dir)
    single = root / SINGLE_FILE
    if single.is_file():
        return [single]
    index = root / INDEX_FILE
    if not index.is_file():
        raise ModelFileNotFoundError(
            f"no weights in {root}: expected {SINGLE_FILE} or {INDEX_FILE}"
        )
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{index} is not a valid safetensors index: {exc}") from exc
    files = [root / name for name in sorted(set(weight_map.values()))]
    for file in files:
        if not file.is_file():
            raise ModelFileNotFoundError(f"missing weights shard {file} (named by {index})")
    return files


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, Path, torch.Tensor]]:
    """Yield ``(tensor name, file, CPU tensor)`` for every tensor in ``files``, one at a time."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, file, reader.get_tensor(name)
