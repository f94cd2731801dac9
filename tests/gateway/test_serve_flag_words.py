"""A refused ``serve`` option is named by its flag (``--max-model-len``), never by the config
field it sets (``max_model_len``): ``serve.args.in_flag_words``, the one table
``serve_flags`` (every option's dest → flag)."""

from __future__ import annotations

import logging

import pytest
from prefixgate.gateway.cli import main
from prefixgate.gateway.serve.args import in_flag_words, serve_flags


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--max-model-len", "0"], "--max-model-len must be >= 1"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["--num-kv-blocks", "0"], "--num-kv-blocks must be >= 1"),
    ],
)
def test_a_refused_engine_option_names_its_flag(flags, said, caplog, aidreams_path):
    with caplog.at_level(logging.ERROR, logger="prefixgate.gateway"):
        code = main(["serve", "--model", aidreams_path, "--port", "0", *flags])
    assert code == 2
    lines = [r.getMessage() for r in caplog.records if "bad option" in r.getMessage()]
    assert lines and said in lines[0], lines
    assert "max_model_len" not in lines[0] and "num_kv_blocks" not in lines[0], lines


def test_in_flag_words_renames_only_a_leading_field():
    assert (
        in_flag_words("max_model_len must be >= 1, got 0") == "--max-model-len must be >= 1, got 0"
    )
    assert (
        in_flag_words("give --config or --upstream, not both")
        == "give --config or --upstream, not both"
    )
    assert in_flag_words("the model max_model_len is ...") == "the model max_model_len is ..."
    flags = serve_flags()
    assert flags["max_model_len"] == "--max-model-len" and flags["upstreams"] == "--upstream"


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--upstream-timeout-s", "-5"], "--upstream-timeout-s must be >= 0, got -5"),
        (["--upstream-timeout-s", "nan"], "--upstream-timeout-s must be >= 0, got nan"),
        (["--shutdown-grace-s", "-1"], "--shutdown-grace-s must be >= 0, got -1"),
    ],
)
def test_a_refused_proxy_option_names_only_its_own_flag(flags, said, caplog):
    """A new user's ``--upstream-timeout-s -5`` was told "--shutdown-grace-s and
    upstream_timeout_s must be >= 0": a flag not given, and a field's name."""
    with caplog.at_level(logging.ERROR, logger="prefixgate.gateway"):
        code = main(["serve", "--upstream", "http://127.0.0.1:9", "--port", "0", *flags])
    assert code == 2
    lines = [r.getMessage() for r in caplog.records if "bad option" in r.getMessage()]
    assert lines and said in lines[0], lines
    assert "_" not in lines[0].split("must")[0], lines
