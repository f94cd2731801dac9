"""Models by name: a Hugging Face hub id (``org/name``) resolved to a local snapshot folder.

``resolve_model("org/name")`` downloads (or finds in the cache) only what the engine reads —
``config.json``, ``generation_config.json``, the tokenizer files, the chat template and the
safetensors weights — with ``huggingface_hub.snapshot_download``, as vLLM does. The cache and
the network follow huggingface_hub's own environment: ``HF_HOME`` / ``HF_HUB_CACHE`` (where
snapshots live), ``HF_HUB_OFFLINE=1`` (cache only, never the network), ``HF_TOKEN`` (gated or
private repositories). A path that exists on disk is always taken as it is.
"""

from __future__ import annotations

import re
from pathlib import Path

from prefixgate.engine.models.errors import ModelFileNotFoundError

# What the engine reads from a model folder (config, tokenizer, template, weights).
CONFIG_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
]
WEIGHT_PATTERNS = ["*.safetensors", "model.safetensors.index.json"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def is_hub_id(model: str) -> bool:
    """``True`` for ``org/name`` (one slash, hub-legal characters, not a relative path)."""
    return bool(_HUB_ID.match(model)) and not model.startswith((".", "~"))


def resolve_model(model: str, *, weights: bool = True, revision: str | None = None) -> str:
    """The local folder of ``model``: the path itself when it exists, else a hub snapshot.

    Args:
        model: a model folder, or a Hugging Face hub id ``org/name``.
        weights: also fetch the safetensors weights (``False`` for ``load_format="dummy"``).
        revision: branch, tag or commit of the hub repository (default ``main``).

    Returns:
        The folder path (for a hub id: ``<cache>/models--org--name/snapshots/<commit>``).

    Raises:
        ModelFileNotFoundError: no such folder and not a hub id; huggingface_hub is not
            installed; or the hub (or, with ``HF_HUB_OFFLINE=1``, the cache) has no such model.
    """
    if Path(model).expanduser().exists():
        return str(Path(model).expanduser())
    if not is_hub_id(model):
        raise ModelFileNotFoundError(
            f"model directory {model!r} does not exist (nor is it a Hugging Face hub id org/name)"
        )
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelFileNotFoundError(
            f"{model!r} is not a local folder; fetching it from the Hugging Face hub needs "
            "huggingface_hub (pip install -e '.[engine]')"
        ) from None
    patterns = CONFIG_PATTERNS + (WEIGHT_PATTERNS if weights else [])
    try:
        return str(snapshot_download(model, revision=revision, allow_patterns=patterns))
    except Exception as exc:  # noqa: BLE001 - huggingface_hub's errors are many; one clear line
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelFileNotFoundError(
            f"cannot get {model!r} from the Hugging Face hub ({type(exc).__name__}: {reason})"
        ) from None
