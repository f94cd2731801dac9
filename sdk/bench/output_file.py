"""An output file named by a flag (``--json``, ``--plot``, ``--out``), checked before the run
that fills it: ``prefixgate sim``, ``prefixgate bench serve`` / ``compare`` and
``prefixgate.engine.sim_fit`` write their results only at the end, so a path that cannot be
written lost the whole run to a traceback (``FileNotFoundError`` after a minutes-long
``prefixgate sim``)."""

from __future__ import annotations

import os


def check_output_file(flag: str, path: str | os.PathLike[str] | None) -> None:
    """Refuse ``path`` (given as ``flag``) at once when the file could not be written later:
    its folder is missing or not writable, or the path is a folder. ``None`` or ``""``: no
    file asked for. Nothing is created or truncated.

    Raises:
        ValueError: naming ``flag`` and the path, saying why.
    """
    if path is None or str(path) == "":
        return
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a folder, not a file")
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path!r}: its folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (
        os.path.exists(path) and not os.access(path, os.W_OK)
    ):
        raise ValueError(f"{flag} {path!r} cannot be written (permission denied)")
