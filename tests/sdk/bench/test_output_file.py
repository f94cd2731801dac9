"""An output file is checked before the run that fills it (``sdk/bench/output_file.py``):
``prefixgate sim --json /no/such/dir/x.json`` ran the whole simulation, printed its report,
then ended in a ``FileNotFoundError`` traceback (a new user's probe); ``bench serve`` /
``bench compare`` (``--json``, ``--plot``) and ``sim_fit --out`` wrote theirs at the end too.
Each is now a one-line refusal, exit 2, before any work."""

from __future__ import annotations

import argparse

import pytest
from prefixgate.sdk.bench.commands import add_bench_parser
from prefixgate.sdk.bench.output_file import check_output_file


def _bench(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="prefixgate")
    add_bench_parser(p.add_subparsers(dest="command", required=True))
    return p.parse_args(argv)


def test_a_file_that_could_not_be_written_is_refused_naming_its_flag(tmp_path):
    check_output_file("--json", None)
    check_output_file("--json", "")
    check_output_file("--json", tmp_path / "new.json")  # a new file in a folder that exists
    assert not (tmp_path / "new.json").exists()  # nothing created
    with pytest.raises(ValueError, match=r"--json .*does not exist"):
        check_output_file("--json", tmp_path / "missing" / "x.json")
    with pytest.raises(ValueError, match=r"--plot .* is a folder"):
        check_output_file("--plot", tmp_path)


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_bench_serve_refuses_a_bad_output_before_any_request(flag, tmp_path, capsys):
    bad = str(tmp_path / "missing" / "out")
    # port 9 answers nothing: had the run started, it would have ended 1 (connection error)
    args = _bench(["bench", "serve", "--base-url", "http://127.0.0.1:9", flag, bad])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert flag in err and "does not exist" in err, err


def test_bench_compare_refuses_a_bad_output_before_any_server(tmp_path, capsys):
    args = _bench(["bench", "compare", "--json", str(tmp_path / "missing" / "out.json")])
    assert args.func(args) == 2
    assert "--json" in capsys.readouterr().err


def test_sim_refuses_a_bad_output_before_the_run(tmp_path, capsys):
    pytest.importorskip("prefixgate.engine.llm_engine")
    from prefixgate.gateway.cli import main

    for flag in ("--json", "--plot"):
        bad = str(tmp_path / "missing" / "out")
        assert main(["sim", "--capacity-rps", "4", "--duration-s", "1", flag, bad]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""  # no report: the run never started
        assert f"bad option: {flag}" in captured.err and "does not exist" in captured.err


def test_sim_fit_refuses_a_bad_out_before_building_the_engine(tmp_path, capsys):
    pytest.importorskip("prefixgate.engine.llm_engine")
    from prefixgate.engine.sim_fit import main

    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "missing" / "profile.json")])
    assert exc.value.code == 2
    assert "--out" in capsys.readouterr().err
