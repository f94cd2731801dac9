"""Errors raised while reading a checkpoint."""

from __future__ import annotations


class ModelFileNotFoundError(FileNotFoundError, ValueError):
    """A model directory, config.json, tokenizer file or weights file is missing.

    Subclasses both ``FileNotFoundError`` and ``ValueError`` so callers that treat a bad
    ``model=`` argument as bad input (``except ValueError``) catch it too.
    """
