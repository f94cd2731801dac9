"""``prefixgate serve --help`` and ``prefixgate --version``: every flag says its meaning and default."""

from __future__ import annotations

import argparse

import pytest
from prefixgate.gateway.cli import build_parser, main, version


def _serve_parser() -> argparse.ArgumentParser:
    parser = build_parser("serve")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_every_serve_flag_has_a_meaning_and_a_default():
    serve = _serve_parser()
    for action in serve._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[0] if action.option_strings else action.metavar
        assert action.help and len(action.help) > 20, flag
        assert "(default:" in action.help, f"{flag}: {action.help}"
    text = serve.format_help()
    for raw in ("``", "GatewaySettings.", "EngineConfig."):
        assert raw not in text, raw


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"prefixgate {version()}"
    assert version()[0].isdigit()


def test_ctrl_c_before_the_server_starts_is_one_line_and_130(monkeypatch, capsys):
    """Was: Ctrl-C while `prefixgate serve` imported torch or read the model's config (the
    seconds before its server and its drain start) printed a KeyboardInterrupt traceback."""
    from prefixgate.gateway.serve import runner

    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "preflight", interrupted)
    assert main(["serve", "--load-format", "dummy", "--port", "0"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "prefixgate: interrupted" and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["serve", "--unknown-flag"], "usage: prefixgate serve"),
        (["sim", "--unknown-flag"], "usage: prefixgate sim"),
        (["bench", "--unknown-flag"], "usage: prefixgate bench"),
        (["bench", "serve", "--base-url", "http://x", "--unknown-flag"], "prefixgate bench serve"),
        (["bench", "compare", "--unknown-flag"], "usage: prefixgate bench compare"),
    ],
)
def test_an_unknown_flag_shows_its_own_commands_usage(argv, usage, capsys):
    """Was: an unknown flag of any subcommand printed the top-level usage (``prefixgate
    [-h] [--version] {serve,bench,sim}``): argparse's sub-parsers leave what they do not
    know to the top-level parser, which then says the error in its own words."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert usage in err.splitlines()[0], err
    assert "unrecognized arguments: --unknown-flag" in err
    assert "{serve,bench,sim}" not in err


def test_an_unknown_top_level_flag_shows_the_top_level_usage(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--unknown-flag", "serve"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: prefixgate [-h]") and "--unknown-flag" in err
