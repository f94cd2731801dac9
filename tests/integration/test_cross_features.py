"""Where request features meet: hypothesis draws chat requests over the real tiny
model (aidreams-260k) through the real gateway and holds the invariants on every one.

Drawn: the constraint (none, ``response_format`` json_schema / json_object, vLLM's regex and
choice, tools with every ``tool_choice`` and ``parallel_tool_calls``) × ``min_tokens`` ×
``max_tokens`` × stop strings × ``stop_token_ids`` × ``logit_bias`` × ``n`` × logprobs ×
temperature 0 or a seed × the prefix cache warm (shared prompt) or cold (a fresh
``cache_salt``) × the route (chat, or the legacy completions for the kinds it takes) × the
server: 256 KV blocks, or 8 (exactly one full-context request:
``n`` up to 3 preempts). Each case is sent twice, whole and streamed (``include_usage``).

Invariants (``check_case``): never a 5xx, a 400 only for the documented conflicts (prompt +
``max_tokens`` over the context, a constraint with a constraining ``tool_choice``), always
naming its ``param``, and always the 400 naming ``stop`` for stop strings beside a
constraint on the whole output; every choice's ``finish_reason`` truthful (``length`` exactly at
``max_tokens`` or the context's end, ``stop`` within it, ``tool_calls`` only with complete
calls), the tokens returned (logprobs entries) add up to ``usage.completion_tokens``, no stop
string in the text, ``min_tokens`` held by a plain answer that stopped; a constrained answer
that stopped validates (``jsonschema``, the regex, the choice) and a required / named call's
arguments validate against its function; at temperature 0 or with a seed the stream equals
the whole answer (content, tool calls, finish reasons, tokens, usage); ``usage`` adds up
(total = prompt + completion, cached <= prompt); the block pool is whole after.

Profiles: ``test_cross_features_fast`` (CI: ``FAST_EXAMPLES`` cases, derandomized, about a
minute on a loaded 2-core machine) and ``test_cross_features_long`` (slow marker,
``LONG_EXAMPLES``). What they found is in ``test_cross_features_regressions.py``. Two more
axes compare against these servers at temperature 0: n-gram speculation
(``test_cross_features_speculative``) and the one-row CPU ops forced on
(``test_cross_features_cpu_ops``: ``decode_layer`` on every lone decode step, each linear on
another one-row kind; the loader keeps them off for aidreams).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("prefixgate.engine.async_engine")

from prefixgate.gateway.local.serving import LOCAL  # noqa: E402
from support.gateway import big_and_small_servers, serve_aidreams, wait_idle  # noqa: E402
from support.schemas import FLAT_SCHEMA as SCHEMA  # noqa: E402
from support.schemas import TIME_TOOL as TIME
from support.schemas import weather_tool

MODEL = "aidreams-260k"
MAX_MODEL_LEN = 128  # aidreams' max_position_embeddings
FAST_EXAMPLES = 150
LONG_EXAMPLES = 2000

REGEX = r"[a-c]{2}-[0-9]"
CHOICE = ["yes", "no", "maybe"]
WEATHER = weather_tool(6, strict=True)
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
# Classes of failure the draws go around while a fix is pending (each named here has its
# regression test in test_cross_features_regressions.py). Empty: every class found is fixed
# (grammar vs min_tokens, stop strings before min_tokens, stop ids under a grammar).
AVOID: set[str] = set()
# aidreams token ids a constrained answer writes often: the bytes { } " : , and the letters
# of the schema's words (a stop id drawn at random from 509 would rarely meet a grammar)
HOT_IDS = [126, 128, 455, 487, 446, 433, 440, 437, 430, 436, 441, 451, 260, 2]
PROMPTS = ["Tell me", "Once upon a time there was", "A pet, please"]
STOPS = ["e", "the", ".", "}", '"', "\n", "a "]


@dataclass
class Case:
    """One drawn request: its JSON body, how to check its answer, and its server."""

    body: dict[str, Any]
    kind: str  # text | json_schema | json_object | regex | choice | tools
    server: str  # "big" | "small"
    route: str = "chat"  # "chat" | "completions"
    tool_choice: Any = None
    tools: list[dict[str, Any]] = field(default_factory=list)

    @property
    def constrained_tools(self) -> bool:
        return self.kind == "tools" and (
            self.tool_choice == "required" or isinstance(self.tool_choice, dict)
        )

    @property
    def deterministic(self) -> bool:
        return self.body.get("temperature") == 0 or "seed" in self.body


KINDS = ["text", "json_schema", "json_object", "regex", "choice", "tools"]


@st.composite
def cases(
    draw: st.DrawFn,
    kinds: list[str] = KINDS,
    penalties: bool = False,
    prompts: list[str] = PROMPTS,
) -> Case:
    kind = draw(st.sampled_from(kinds))
    prompt = draw(st.sampled_from(prompts))
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
    case = Case(body, kind, draw(st.sampled_from(["big", "small"])))
    if kind not in ("tools", "json_schema", "json_object") and draw(st.integers(0, 2)) == 0:
        case.route = "completions"  # the legacy route: a prompt, its own logprobs shape
        body["prompt"] = body.pop("messages")[0]["content"]
    if kind == "json_schema":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": SCHEMA, "strict": True},
        }
    elif kind == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif kind == "regex":
        if draw(st.booleans()):
            body["structured_outputs"] = {"regex": REGEX}
        else:
            body["guided_regex"] = REGEX
    elif kind == "choice":
        body["structured_outputs"] = {"choice": CHOICE}
    elif kind == "tools":
        case.tools = draw(st.sampled_from([[WEATHER], [TIME], [WEATHER, TIME]]))
        body["tools"] = case.tools
        names = [t["function"]["name"] for t in case.tools]
        choices: list[Any] = [None, "none", "auto", "required"]
        choices += [{"type": "function", "function": {"name": n}} for n in names]
        case.tool_choice = draw(st.sampled_from(choices))
        if case.tool_choice is not None:
            body["tool_choice"] = case.tool_choice
        parallel = draw(st.sampled_from([None, True, False]))
        if parallel is not None:
            body["parallel_tool_calls"] = parallel
    body["max_tokens"] = max_tokens = draw(st.integers(1, 60))
    # a grammar: a constraint, a constraining tool_choice, or "auto" with a strict tool's tag
    grammar = kind != "text" and not (kind == "tools" and case.tool_choice == "none")
    if draw(st.booleans()) and not (grammar and "grammar_min_tokens" in AVOID):
        body["min_tokens"] = draw(st.integers(0, max_tokens))
    if draw(st.integers(0, 3)) == 0 and not (
        body.get("min_tokens") and "stop_strings_min_tokens" in AVOID
    ):
        body["stop"] = draw(st.lists(st.sampled_from(STOPS), min_size=1, max_size=2, unique=True))
    if draw(st.integers(0, 3)) == 0 and not (grammar and "stop_ids_grammar" in AVOID):
        ids = st.sampled_from(HOT_IDS) | st.integers(3, 511)
        body["stop_token_ids"] = draw(st.lists(ids, min_size=1, max_size=3))
    if draw(st.integers(0, 3)) == 0:
        bias = st.integers(-100, 100) | st.sampled_from([-100, 100])
        body["logit_bias"] = draw(st.dictionaries(st.integers(3, 511).map(str), bias, max_size=3))
    body["n"] = draw(st.integers(1, 3))
    if draw(st.booleans()):
        if case.route == "chat":
            body["logprobs"] = True
            body["top_logprobs"] = draw(st.integers(0, 3))
        else:
            body["logprobs"] = draw(st.integers(0, 3))
    if draw(st.booleans()):
        body["temperature"] = 0
    else:
        body["temperature"] = draw(st.sampled_from([0.7, 1.0]))
        body["seed"] = draw(st.integers(0, 10_000))
    if draw(st.booleans()):  # cold: nothing of it is in the prefix cache
        body["cache_salt"] = uuid.uuid4().hex
    if penalties and draw(st.integers(0, 2)) == 0:
        body["frequency_penalty"] = draw(st.sampled_from([0.5, 1.5]))
        body["presence_penalty"] = draw(st.sampled_from([-0.5, 1.0]))
    if penalties and draw(st.integers(0, 3)) == 0:
        body["repetition_penalty"] = draw(st.sampled_from([0.8, 1.3]))
    return case


@dataclass
class Answer:
    """What one request returned, whole or assembled from its stream."""

    status: int
    error: dict[str, Any] | None = None
    contents: list[str | None] = field(default_factory=list)
    calls: list[list[tuple[str, str]]] = field(default_factory=list)
    finishes: list[str | None] = field(default_factory=list)
    tokens: list[int | None] = field(default_factory=list)  # logprobs entries per choice
    texts: list[list[str] | None] = field(default_factory=list)  # each token's text (whole)
    usage: dict[str, Any] | None = None


def _lp_count(route: str, lp: dict[str, Any] | None) -> int | None:
    """Tokens a choice's (or chunk's) logprobs cover: chat ``content`` entries, or the
    completions route's ``tokens``."""
    if not lp:
        return None
    return len(lp["content"] if route == "chat" else lp["tokens"])


def _whole(http: httpx.Client, url: str, case: Case) -> Answer:
    body, route = case.body, case.route
    r = http.post(f"{url}/v1/{'chat/completions' if route == 'chat' else 'completions'}", json=body)
    data = r.json()
    if r.status_code != 200:
        return Answer(r.status_code, data.get("error"))
    ans = Answer(200, usage=data["usage"])
    for i, c in enumerate(data["choices"]):
        assert c["index"] == i, data
        msg = c["message"] if route == "chat" else {"content": c["text"]}
        ans.contents.append(msg.get("content"))
        calls = [
            (t["function"]["name"], t["function"]["arguments"]) for t in msg.get("tool_calls") or []
        ]
        ans.calls.append(calls)
        ans.finishes.append(c["finish_reason"])
        lp = c.get("logprobs")
        ans.tokens.append(_lp_count(route, lp))
        if not lp:
            ans.texts.append(None)
        else:
            ans.texts.append(
                [e["token"] for e in lp["content"]] if route == "chat" else lp["tokens"]
            )
    return ans


def _streamed(http: httpx.Client, url: str, case: Case) -> Answer:
    route = case.route
    body = {**case.body, "stream": True, "stream_options": {"include_usage": True}}
    n = body.get("n", 1)
    path = "chat/completions" if route == "chat" else "completions"
    with http.stream("POST", f"{url}/v1/{path}", json=body) as r:
        if r.status_code != 200:
            r.read()
            return Answer(r.status_code, r.json().get("error"))
        ans = Answer(200)
        contents = [""] * n
        calls: list[dict[int, list[str]]] = [{} for _ in range(n)]
        finishes: list[str | None] = [None] * n
        tokens: list[int | None] = [None] * n
        done = False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            assert "error" not in chunk, chunk  # a stream cut short by the server
            if chunk.get("usage"):
                ans.usage = chunk["usage"]
            for c in chunk["choices"]:
                i = c["index"]
                assert finishes[i] is None, f"choice {i} has content after its finish: {chunk}"
                d = c["delta"] if route == "chat" else {"content": c["text"]}
                contents[i] += d.get("content") or ""
                for tc in d.get("tool_calls") or []:
                    slot = calls[i].setdefault(tc["index"], ["", ""])
                    fn = tc.get("function") or {}
                    slot[0] += fn.get("name") or ""
                    slot[1] += fn.get("arguments") or ""
                if c.get("logprobs"):
                    tokens[i] = (tokens[i] or 0) + (_lp_count(route, c["logprobs"]) or 0)
                finishes[i] = c.get("finish_reason") or finishes[i]
        assert done, "the stream ended without [DONE]"
    ans.contents = list(contents)
    ans.calls = [[tuple(cs[k]) for k in sorted(cs)] for cs in calls]  # type: ignore[misc]
    for cs in calls:
        assert sorted(cs) == list(range(len(cs))), cs  # tool-call indexes 0, 1, ...
    ans.finishes = finishes
    ans.tokens = tokens if body.get("logprobs") is not None else [None] * n
    return ans


def _stop_refused(case: Case) -> bool:
    """Stop strings beside a constraint on the whole output (a constraint kind, or a
    constraining ``tool_choice``) are refused, 400 naming ``stop``, before anything else
    (``gateway/wire/stop_strings.py``: one matched inside the constrained text cut it)."""
    whole = case.kind in ("json_schema", "json_object", "regex", "choice")
    return bool(case.body.get("stop")) and (whole or case.constrained_tools)


def _allowed_400(case: Case, err: dict[str, Any]) -> bool:
    """The one 400 a drawn request may get: prompt + ``max_tokens`` over the context (the
    draws never put a constraint beside a constraining ``tool_choice``)."""
    return err.get("code") == "context_length_exceeded"


def _valid(case: Case, text: str) -> None:
    if case.kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif case.kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif case.kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif case.kind == "choice":
        assert text in CHOICE, text


def check_answer(case: Case, ans: Answer, how: str) -> None:
    """The invariants on one answer (``how``: "whole" / "stream", for the messages)."""
    body = case.body
    where = f"{how}: {ans}"
    assert ans.status < 500, where
    if _stop_refused(case):
        assert ans.status == 400 and ans.error and ans.error.get("param") == "stop", where
        return
    if ans.status != 200:
        assert ans.status == 400 and ans.error and ans.error.get("param"), where
        assert _allowed_400(case, ans.error), where
        return
    n, max_tokens = body["n"], body["max_tokens"]
    assert len(ans.finishes) == n and ans.usage is not None, where
    usage = ans.usage
    prompt_tokens = usage["prompt_tokens"]
    assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"], where
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert 0 <= cached <= prompt_tokens, where
    room = min(max_tokens, MAX_MODEL_LEN - prompt_tokens)
    counted = [t for t in ans.tokens if t is not None]
    if len(counted) == n:  # logprobs: one entry per token returned
        assert sum(counted) == ans.usage["completion_tokens"], where
    elif n == 1:
        counted = [ans.usage["completion_tokens"]]
    per_choice = counted if len(counted) == n else [None] * n
    stops = body.get("stop") or []
    for i in range(n):
        finish, content, calls, tokens = (
            ans.finishes[i],
            ans.contents[i],
            ans.calls[i],
            per_choice[i],
        )
        assert finish in ("stop", "length", "tool_calls"), where
        if tokens is not None:
            assert 1 <= tokens <= room, where
            if finish == "length":
                assert tokens == room, where
        if finish == "tool_calls":
            assert calls and case.kind == "tools", where
        if case.kind != "tools" or case.tool_choice == "none":
            assert not calls, where
        text = content or ""
        if case.constrained_tools:
            assert not text, f"constrained tool answer with content: {where}"
            if case.tool_choice != "required" or (
                len(case.tools) == 1 or body.get("parallel_tool_calls") is False
            ):
                assert len(calls) <= 1, where
            if finish == "tool_calls":
                for name, args in calls:
                    jsonschema.validate(json.loads(args), PARAMS[name])
        # stop strings apply only after min_tokens (vLLM): none may end past the text of
        # the first min_tokens tokens (known from logprobs; unknown without them)
        min_tokens = body.get("min_tokens", 0)
        exempt = 0
        if min_tokens:
            token_texts = ans.texts[i] if ans.texts else None
            exempt = len("".join(token_texts[:min_tokens])) if token_texts else len(text)
        for s in stops:
            at = text.find(s)
            while at >= 0:
                assert at + len(s) <= exempt, f"stop string {s!r} in the text: {where}"
                at = text.find(s, at + 1)
        constrained = case.kind in ("json_schema", "json_object", "regex", "choice")
        if finish == "stop" and constrained and not stops:
            try:
                _valid(case, text)
            except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
                raise AssertionError(
                    f"finished constrained answer invalid ({exc}): {where}"
                ) from None
        if finish == "stop" and case.kind == "text" and tokens is not None:
            assert tokens >= body.get("min_tokens", 0), f"stopped before min_tokens: {where}"


def check_case(case: Case, servers: dict[str, Any], http: httpx.Client, pool_whole) -> None:
    """Send ``case`` whole and streamed; every invariant of the module docstring."""
    srv = servers[case.server]
    whole = _whole(http, srv.url, case)
    check_answer(case, whole, "whole")
    streamed = _streamed(http, srv.url, case)
    check_answer(case, streamed, "stream")
    if whole.status == 200 and case.deterministic:
        norm = [c or "" for c in whole.contents]
        assert (streamed.contents, streamed.calls, streamed.finishes) == (
            norm,
            whole.calls,
            whole.finishes,
        ), f"stream != whole:\n{whole}\n{streamed}"
        assert streamed.tokens == whole.tokens, (whole, streamed)
        assert streamed.usage["completion_tokens"] == whole.usage["completion_tokens"]
        assert streamed.usage["prompt_tokens"] == whole.usage["prompt_tokens"]
    assert whole.status == streamed.status, (whole, streamed)
    wait_idle(srv, pool_whole)


servers = big_and_small_servers(MODEL)


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=60) as client:
        yield client


_COMMON = {
    "deadline": None,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
}


@settings(max_examples=FAST_EXAMPLES, derandomize=True, **_COMMON)
@given(case=cases())
def test_cross_features_fast(servers, http, pool_whole, case):
    check_case(case, servers, http, pool_whole)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # thousands of cases: past the suite's per-test limit
@settings(max_examples=LONG_EXAMPLES, **_COMMON)
@given(case=cases())
def test_cross_features_long(servers, http, pool_whole, case):
    check_case(case, servers, http, pool_whole)


# ---- speculation as one more axis ----------------------------------------------------------

SPEC_EXAMPLES = 60
SPEC = {"speculative_method": "ngram", "num_speculative_tokens": 4, "spec_min_acceptance": 0.0}


@pytest.fixture(scope="module")
def spec_servers(aidreams_path):
    """The same two servers with n-gram speculation on (never paused: every decode that finds
    an n-gram verifies drafts)."""
    big = serve_aidreams(
        aidreams_path, engine_args=SPEC, model_name=MODEL, tool_call_parser="hermes"
    )
    small = serve_aidreams(aidreams_path, 8, SPEC, model_name=MODEL, tool_call_parser="hermes")
    out = {"big": next(big), "small": next(small)}
    yield out
    for gen in (big, small):
        next(gen, None)


def check_beside_plain(
    case: Case, servers: dict[str, Any], other: dict[str, Any], http, pool_whole
) -> None:
    """Every invariant of ``check_case`` on the ``other`` servers (speculation on, or the CPU
    ops); at temperature 0 the answer equals the plain servers' (content, calls, finish
    reasons, tokens, usage): the stop strings, ``max_tokens``, ``min_tokens``, ``logit_bias``
    and penalties held at every accepted draft, and on every step taken by the one-row ops,
    as they do token by token on the torch path."""
    check_case(case, other, http, pool_whole)
    if case.body.get("temperature") != 0:
        return
    plain = _whole(http, servers[case.server].url, case)
    spec = _whole(http, other[case.server].url, case)
    assert plain.status == spec.status, (plain, spec)
    if plain.status == 200:
        assert (spec.contents, spec.calls, spec.finishes, spec.tokens) == (
            plain.contents,
            plain.calls,
            plain.finishes,
            plain.tokens,
        ), f"other != plain:\n{plain}\n{spec}"
        assert spec.usage["completion_tokens"] == plain.usage["completion_tokens"]
    wait_idle(servers[case.server], pool_whole)
    wait_idle(other[case.server], pool_whole)


# drafts are verified for requests without a grammar or logprobs: mostly those
SPEC_KINDS = ["text", "text", "text", "tools", "regex"]
# aidreams' own phrases, which it goes on repeating (its drafts are accepted most)
SPEC_PROMPTS = [*PROMPTS, "Contrast edges sharpen, as I adjust, as I adjust, as I adjust, as I"]


@settings(max_examples=SPEC_EXAMPLES, derandomize=True, **_COMMON)
@given(case=cases(SPEC_KINDS, penalties=True, prompts=SPEC_PROMPTS))
def test_cross_features_speculative(servers, spec_servers, http, pool_whole, case):
    check_beside_plain(case, servers, spec_servers, http, pool_whole)


def test_cross_features_speculative_verified_drafts(spec_servers, http, pool_whole):
    """The axis is real: the spec servers verified drafts and accepted some (after the drawn
    cases when the module runs whole; a greedy request of its own first either way)."""
    srv = spec_servers["big"]
    print(
        {k: v for k, v in srv.app[LOCAL].engine.stats().items() if "spec" in k},
        {k: v for k, v in spec_servers["small"].app[LOCAL].engine.stats().items() if "spec" in k},
    )
    body = {"model": MODEL, "prompt": SPEC_PROMPTS[-1], "max_tokens": 40, "temperature": 0}
    assert http.post(f"{srv.url}/v1/completions", json=body).status_code == 200
    stats = srv.app[LOCAL].engine.stats()
    assert stats["spec_decode_num_drafts"] > 0, stats
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats
    wait_idle(srv, pool_whole)


# ---- the one-row CPU ops as one more axis ---------------------------------------------------

OPS_EXAMPLES = 120


@pytest.fixture(scope="module")
def ops_servers(aidreams_path):
    """The same two servers with the one-row CPU ops forced on (aidreams is under the loader's
    size gate, so no other test's server runs them): every step of one decode token alone runs
    ``cpu_ext.decode_layer``, each linear on another one-row kind (the AVX2 GEMV, ``mm_t``,
    ``linear``, oneDNN's packed weight), while ``n`` > 1, prefills and the 8-block server's
    preemptions run the torch path between them."""
    from prefixgate.engine.models.cpu_linear import OneDNNLinear
    from prefixgate.engine.models.layers import set_one_row_layers, set_one_row_ops
    from prefixgate.kernels import cpu_ext

    if not cpu_ext.available():
        pytest.skip("prefixgate CPU ops not built here (no AVX2 or no compiler)")
    big = serve_aidreams(aidreams_path, model_name=MODEL, tool_call_parser="hermes")
    small = serve_aidreams(
        aidreams_path, num_kv_blocks=8, model_name=MODEL, tool_call_parser="hermes"
    )
    out = {"big": next(big), "small": next(small)}
    kinds = ["gemv", "mm_t", "linear", "onednn"]
    for srv in out.values():  # before any request: the step thread reads the flags
        model = srv.app[LOCAL].engine.engine.runner.model
        linears = [m for m in model.modules() if isinstance(m, OneDNNLinear)]
        for i, m in enumerate(linears):
            m.set_one_row(kinds[i % len(kinds)])
        set_one_row_ops(model, True)
        assert set_one_row_layers(model, True) == model.config.num_layers
    yield out
    for gen in (big, small):
        next(gen, None)


@settings(max_examples=OPS_EXAMPLES, derandomize=True, **_COMMON)
@given(case=cases())
def test_cross_features_cpu_ops(servers, ops_servers, http, pool_whole, case):
    check_beside_plain(case, servers, ops_servers, http, pool_whole)


def test_cross_features_cpu_ops_ran(ops_servers, http, pool_whole, monkeypatch):
    """The axis is real: a lone greedy request on the ops server goes through
    ``cpu_ext.decode_layer`` (looked up at each call, so a counting wrapper sees it)."""
    from prefixgate.kernels import cpu_ext

    calls = {"n": 0}
    real = cpu_ext.decode_layer

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_ext, "decode_layer", counting)
    srv = ops_servers["big"]
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    assert http.post(f"{srv.url}/v1/completions", json=body).status_code == 200
    assert calls["n"] > 0
    wait_idle(srv, pool_whole)
