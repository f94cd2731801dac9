"""docs/options.md is what ``prefixgate serve --help`` says: regenerate it when a flag changes."""

from __future__ import annotations

import argparse
from pathlib import Path

from prefixgate.gateway.serve.options_page import _serve_parser, main, render_options_page

PAGE = Path(__file__).resolve().parents[2] / "docs" / "options.md"


def test_options_page_is_current():
    assert PAGE.read_text(encoding="utf-8") == render_options_page(), (
        "docs/options.md is stale: run python -m prefixgate.gateway.serve.options_page "
        "docs/options.md"
    )


def test_every_serve_flag_is_on_the_page():
    text = render_options_page()
    flags = [
        s
        for a in _serve_parser()._actions
        if a.help != argparse.SUPPRESS
        for s in a.option_strings
        if s.startswith("--") and s != "--help"
    ]
    assert len(flags) > 50
    missing = [f for f in flags if f"`{f}`" not in text]
    assert not missing


def test_check_mode_names_the_command(tmp_path, capsys):
    stale = tmp_path / "options.md"
    stale.write_text("old\n")
    assert main(["--check", str(stale)]) == 1
    assert "python -m prefixgate.gateway.serve.options_page" in capsys.readouterr().err
    assert main([str(stale)]) == 0 and main(["--check", str(stale)]) == 0
