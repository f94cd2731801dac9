"""``prefixgate serve MODEL`` as ``vllm serve MODEL``: the positional model is ``--model``;
both given and different is a bad option (docs/upstreams.md writes ``prefixgate serve MODEL``)."""

from __future__ import annotations

import pytest
from prefixgate.gateway.cli import build_parser
from prefixgate.gateway.serve.args import positional_model


def _args(*argv: str):
    args = build_parser("serve").parse_args(["serve", *argv])
    positional_model(args)
    return args


def test_a_positional_model_is_the_model(aidreams_path):
    assert _args(aidreams_path).model == aidreams_path
    args = _args(aidreams_path, "--scheduling-policy", "priority", "--port", "0")
    assert args.model == aidreams_path and args.port == 0
    assert _args("--model", aidreams_path).model == aidreams_path
    assert _args(aidreams_path, "--model", aidreams_path).model == aidreams_path  # the same
    assert _args().model is None


def test_a_positional_model_and_another_model_flag_are_refused(aidreams_path):
    with pytest.raises(ValueError, match="positional MODEL .* and --model .* differ"):
        _args(aidreams_path, "--model", "other")


def test_vllms_enable_auto_tool_choice_is_taken_beside_a_parser(aidreams_path):
    """``vllm serve M --enable-auto-tool-choice --tool-call-parser hermes`` ran as
    ``prefixgate serve`` only to end in "unrecognized arguments: --enable-auto-tool-choice"
    (a new user's vLLM command line); as in vLLM, the flag needs a parser."""
    from prefixgate.gateway.serve.args import check_auto_tool_choice

    args = _args(aidreams_path, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    check_auto_tool_choice(args)
    assert args.tool_call_parser == "hermes"
    check_auto_tool_choice(_args(aidreams_path))  # neither: nothing to check
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        check_auto_tool_choice(_args(aidreams_path, "--enable-auto-tool-choice"))
