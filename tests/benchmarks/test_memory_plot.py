"""memory_plot draws memory_curve's JSON results; memory_curve's slope is in KB per request,
its prompts come in three kinds, its heap reading counts held bytes."""

from __future__ import annotations

import json

import pytest

from examples.benchmarks.memory_curve import slope_kb_per_request
from examples.benchmarks.memory_plot import main


def test_slope_is_kb_per_request():
    points = [(i * 1000, 100_000 + i * 1000) for i in range(5)]  # 1 KiB per request
    assert slope_kb_per_request(points) == pytest.approx(1.024)
    assert slope_kb_per_request(points[:1]) == 0.0


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    run = {"rss_kib": [[0, 700_000], [500, 701_000]], "slope_kb_per_request_second_half": 0.1}
    src = tmp_path / "run.json"
    src.write_text(json.dumps(run))
    out = tmp_path / "curve.png"
    main([str(out), str(src), "--label", "local"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit, match="rss_kib"):
        main([str(out), str(tmp_path / "bad.json")])


def test_prompt_kinds():
    from examples.benchmarks.memory_curve import prompt_text

    assert prompt_text("distinct", 7) != prompt_text("distinct", 70)
    fixed = {prompt_text("fixed", i) for i in (0, 7, 70_000, 999_999)}
    assert len(fixed) == 4 and len({len(t) for t in fixed}) == 1
    assert prompt_text("identical", 1) == prompt_text("identical", 2)
    with pytest.raises(ValueError, match="distinct, fixed or identical"):
        prompt_text("random", 1)


def test_mixed_dialects_take_turns():
    from examples.benchmarks.memory_curve import request_of

    got = [request_of("m", i, 4, "mixed")[::2] for i in range(8)]
    chat, messages = "/v1/chat/completions", "/v1/messages"
    turn = [(chat, True), (chat, False), (messages, False), (messages, True)]
    assert got == turn * 2
    path, body, _ = request_of("m", 2, 4, "mixed")
    assert body["max_tokens"] == 4 and body["metadata"] == {"user_id": "user-2"}
    assert {request_of("m", i, 4, "chat")[::2] for i in range(4)} == {(chat, False)}
    with pytest.raises(ValueError, match="dialects"):
        request_of("m", 0, 4, "gemini")


def test_plot_draws_heap_beside_rss(tmp_path):
    pytest.importorskip("matplotlib")
    run = {"rss_kib": [[0, 700_000], [500, 701_000]], "heap_bytes": [[0, 1 << 29], [500, 1 << 29]]}
    src = tmp_path / "run.json"
    src.write_text(json.dumps(run))
    main([str(tmp_path / "curve.png"), str(src)])
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_heap_in_use_counts_a_held_allocation():
    import ctypes

    from examples.benchmarks.memory_curve import heap_in_use

    before = heap_in_use()
    if before is None:
        pytest.skip("glibc without mallinfo2")
    buf = ctypes.create_string_buffer(8 << 20)  # malloc'ed by ctypes: 8 MiB held
    held = heap_in_use() - before
    del buf
    assert held >= 8 << 20
