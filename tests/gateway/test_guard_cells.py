"""The shared request guards, over the cells ``test_edge_combinations.py`` and the both-modes
tests leave open: every generating dialect (OpenAI chat, completions and Responses, Anthropic
Messages and
``count_tokens``, Gemini ``generateContent`` / ``streamGenerateContent`` / ``countTokens``) ×
stream on/off × the guard's defect kinds (``n`` / ``candidateCount`` bounds, ``max_tokens``
bounds and types, ``stop`` bounds and types, ``seed`` bounds, one tool over the bound, a body
that is no JSON object or no JSON at all, a body over ``--max-body-bytes``) × the key (open,
missing, unknown, over its request rate), in local mode and through a proxy in front of a
prefixgate upstream.

Drawn with hypothesis (derandomized, ``GUARD_CELL_EXAMPLES`` examples, 150 by default: about
10 s on the fake engine). For every draw (``check_cell``):

- the answer is the dialect's own error object (OpenAI ``{"error": {"message", "type",
  "param", "code"}}``, Anthropic ``{"type": "error", "error": {"type", "message"}}``, Gemini
  ``{"error": {"code", "message", "status"}}``) at the status the cell predicts: 401 for a
  missing or unknown key, 413 for a body over the bound, 429 with ``Retry-After`` in [1, 600]
  for a key over its rate, else a 400 naming the defect's field (``invalid_json`` for a body
  that is no JSON object);
- local mode and the proxy give the same status and, but for a 429 (whose wait is each
  server's own), the same error object; save one known exception: a spent key beside a body
  local mode refuses is its 400 locally, a 429 through the proxy, which admits before its
  upstream judges the body (``SPENT_KEY_ORDER``, a strict xfail);
- afterwards both engines are idle with their KV pools whole, and both gateways' admission
  counts and the keys' in-flight counts are 0.

The Responses route is relayed by the proxy as a chat (``proxy/responses_relay.py``); its
cells are these too (its ``max_output_tokens`` the ``max_tokens`` kind; ``n``, ``stop`` and
``seed`` are no Responses fields: a 400 naming them as unknown).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prefixgate.gateway.app import create_app, create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.local.serving import LOCAL
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.state import STATE
from support.fake_engine import FakeEngine, wait_idle
from support.fuzz import live_server_settings

EXAMPLES = int(os.environ.get("GUARD_CELL_EXAMPLES", "150"))
MODEL = "fake"
MAX_BODY = 16 * 1024  # --max-body-bytes of both gateways: a 413 costs 16 KiB
OPEN, SPENT, WRONG = "k-open", "k-spent", "k-wrong"
KEYS = {
    "keys": [
        {"key": OPEN, "name": "open"},
        {"key": SPENT, "name": "spent", "requests_per_minute": 1},
    ]
}
CHAT, COMP, RESP = "/v1/chat/completions", "/v1/completions", "/v1/responses"
MSG, MSG_COUNT = "/v1/messages", "/v1/messages/count_tokens"
GEN = f"/v1beta/models/{MODEL}:generateContent"
GEN_STREAM = f"/v1beta/models/{MODEL}:streamGenerateContent?alt=sse"
GEN_COUNT = f"/v1beta/models/{MODEL}:countTokens"
ROUTES = [CHAT, COMP, RESP, MSG, MSG_COUNT, GEN, GEN_STREAM, GEN_COUNT]
STREAMS = {CHAT, COMP, RESP, MSG}  # routes with a ``stream`` field
BIG = 10**6  # more tokens than the context (128)
I64 = 2**63


def dialect(path: str) -> str:
    return (
        "openai"
        if path in (CHAT, COMP, RESP)
        else "anthropic"
        if path.startswith(MSG)
        else "gemini"
    )


# defect kind -> [(the request field it sets, value, the field the 400 must name)], per dialect;
# a field that is not the dialect's is unknown there: a 400 naming it all the same
OPENAI_DEFECTS = {
    "n": [("n", v, "n") for v in (0, -1, 17, 10**6, "2", 1.5, True)],
    "max_tokens": [("max_tokens", v, "max_tokens") for v in (0, -1, 1.5, True, "5", BIG, 2**64)],
    "stop": [("stop", v, "stop") for v in (["a"] * 5, [""], [1], 5, ["a", None], {"a": 1})],
    "seed": [("seed", v, "seed") for v in (I64, 2**64, -I64 - 1, "1", 1.5)],
}
ANTHROPIC_DEFECTS = {
    "n": [("n", 2, "n")],
    "max_tokens": [("max_tokens", v, "max_tokens") for v in (0, -1, 1.5, True, "5", BIG)],
    "stop": [("stop_sequences", v, "stop_sequences") for v in (["a"] * 17, [""], [1], "a", [None])],
    "seed": [("seed", 1, "seed")],
}
RESPONSES_DEFECTS = {
    "n": [("n", 2, "n")],
    "max_tokens": [
        ("max_output_tokens", v, "max_output_tokens") for v in (0, -1, 1.5, True, "5", BIG)
    ],
    "stop": [("stop", v, "stop") for v in (["a"], "a")],
    "seed": [("seed", 1, "seed")],
}
GEMINI_DEFECTS = {
    "n": [("candidateCount", v, "candidateCount") for v in (0, -1, 9, 10**6, "x", 1.5)],
    "max_tokens": [
        ("maxOutputTokens", v, "maxOutputTokens") for v in (0, -1, 1.5, True, "many", BIG)
    ],
    "stop": [("stopSequences", v, "stopSequences") for v in (["a"] * 6, [""], [1], "a", [None])],
    "seed": [("seed", v, "seed") for v in (I64, 2**64, -I64 - 1, "x", 1.5)],
}
TOOLS = 129  # one over the guard's bound (--max-request-tools, 128)
OPENAI_TOOLS = [
    {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
    for i in range(TOOLS)
]
ANTHROPIC_TOOLS = [{"name": f"f{i}", "input_schema": {"type": "object"}} for i in range(TOOLS)]
GEMINI_TOOLS = [
    {
        "functionDeclarations": [
            {"name": f"f{i}", "parameters": {"type": "object"}} for i in range(TOOLS)
        ]
    }
]
RAW = [b"", b"{", b"[]", b"5", b"null", b'"x"', b"\xff\xfe", b'{"model": "fake"']
KINDS = ["n", "max_tokens", "stop", "seed", "tools", "raw", "size"]


@dataclass
class Cell:
    """One request: its route, stream flag, key, body (bytes) and the answer it must get."""

    path: str
    stream: bool
    key: str | None
    kind: str
    content: bytes
    field: str | None = None  # the field the 400 must name (None: a body refused whole)
    count_generates_nothing: bool = False  # a count route's field it may take or refuse

    @property
    def dialect(self) -> str:
        return dialect(self.path)

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.key is None:
            return h
        if self.dialect == "gemini":
            return {**h, "x-goog-api-key": self.key}
        if self.dialect == "anthropic":
            return {**h, "x-api-key": self.key, "anthropic-version": "2023-06-01"}
        return {**h, "Authorization": f"Bearer {self.key}"}

    @property
    def status(self) -> int:
        """The status the cell's defect must get (401 for a missing or unknown key); a spent
        key may get a 429 instead (``check_cell``)."""
        if self.key in (None, WRONG):
            return 401
        return 413 if self.kind == "size" else 400


def base_body(path: str, stream: bool) -> dict[str, Any]:
    """A body the route serves (a 200 with the open key)."""
    if path == CHAT:
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
        }
    elif path == COMP:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    elif path == RESP:
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
    elif path == MSG:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    elif path == MSG_COUNT:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    else:
        body = {
            "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
            "generationConfig": {"maxOutputTokens": 2},
        }
    if stream:
        body["stream"] = True
    return body


def with_defect(path: str, body: dict[str, Any], field: str, value: Any) -> tuple[dict, str]:
    """``body`` with ``field`` set to ``value`` where its dialect keeps it; the field's wire
    path (what the 400 names)."""
    if dialect(path) != "gemini":
        return {**body, field: value}, field
    config = {**body["generationConfig"], field: value}
    if path == GEN_COUNT:
        inner = {"model": f"models/{MODEL}", **body, "generationConfig": config}
        return {"generateContentRequest": inner}, f"generateContentRequest.generationConfig.{field}"
    return {**body, "generationConfig": config}, f"generationConfig.{field}"


@st.composite
def cells(draw: st.DrawFn) -> Cell:
    path = draw(st.sampled_from(ROUTES))
    stream = path in STREAMS and draw(st.booleans())
    key = draw(st.sampled_from([OPEN, OPEN, OPEN, OPEN, None, WRONG, SPENT]))
    kind = draw(st.sampled_from(KINDS))
    body = base_body(path, stream)
    if kind == "raw":
        return Cell(path, stream, key, kind, draw(st.sampled_from(RAW)))
    if kind == "size":
        body["padding"] = "x" * MAX_BODY
        return Cell(path, stream, key, kind, json.dumps(body).encode())
    if kind == "tools":  # the guard's bound, by name at any depth (json_guard.FIELD_LIMITS)
        if dialect(path) == "gemini":
            body["tools"] = GEMINI_TOOLS
            field = "tools.0.functionDeclarations"
            if path == GEN_COUNT:
                body = {"generateContentRequest": {"model": f"models/{MODEL}", **body}}
                field = f"generateContentRequest.{field}"
        else:
            body["tools"] = OPENAI_TOOLS if dialect(path) == "openai" else ANTHROPIC_TOOLS
            field = "tools"
        return Cell(path, stream, key, kind, json.dumps(body).encode(), field)
    table = {"openai": OPENAI_DEFECTS, "anthropic": ANTHROPIC_DEFECTS, "gemini": GEMINI_DEFECTS}
    defects = RESPONSES_DEFECTS if path == RESP else table[dialect(path)]
    name, value, _ = draw(st.sampled_from(defects[kind]))
    if path == MSG_COUNT and name == "max_tokens":
        body.pop("max_tokens", None)
    sent, wire = with_defect(path, body, name, value)
    cell = Cell(path, stream, key, kind, json.dumps(sent).encode(), wire)
    # a count generates nothing: a Gemini count may count a body whose maxOutputTokens is over
    # the context (test_edge_combinations.to_count)
    cell.count_generates_nothing = path == GEN_COUNT and value == BIG
    return cell


# --- the answer ------------------------------------------------------------------------------
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    413: "request_too_large",
    429: "rate_limit_error",
}
GEMINI_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
}


def dialect_error(cell: Cell, r: httpx.Response) -> dict[str, Any]:
    """The dialect's error object of ``r`` (asserting its shape); its inner ``error``."""
    why = f"{cell}\n-> {r.status_code} {r.text[:500]}"
    assert r.headers["content-type"].startswith("application/json"), why
    body = r.json()
    assert isinstance(body, dict), why
    if cell.dialect == "anthropic":
        assert body.get("type") == "error" and set(body) <= {"type", "error", "request_id"}, why
        err = body["error"]
        assert set(err) == {"type", "message"}, why
        assert err["type"] == ANTHROPIC_TYPES[r.status_code], why
    elif cell.dialect == "gemini":
        assert set(body) == {"error"}, why
        err = body["error"]
        assert {"code", "message", "status"} <= set(err) <= {"code", "message", "status",
                                                            "details"}, why  # fmt: skip
        assert err["code"] == r.status_code, why
        assert err["status"] == GEMINI_STATUS[r.status_code], why
    else:
        assert set(body) == {"error"}, why
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, why
    assert isinstance(err["message"], str) and err["message"], why
    return err


def named(dialect_name: str, err: dict[str, Any]) -> list[str]:
    """The fields an error names: OpenAI's ``param``; Gemini's field violations; and, in every
    dialect, the dotted path a message starts with or says is unrecognized."""
    out = []
    if dialect_name == "openai" and err.get("param"):
        out.append(err["param"])
    for detail in err.get("details") or []:
        out += [v["field"] for v in detail.get("fieldViolations", [])]
    message = err["message"]
    head = re.match(r"([A-Za-z_][\w.]*): ", message)
    if head:
        out.append(head.group(1))
    tail = re.search(r"argument supplied: ([\w.]+)", message)
    if tail:
        out.append(tail.group(1))
    return out


def names_field(cell: Cell, err: dict[str, Any]) -> bool:
    assert cell.field is not None
    fields = named(cell.dialect, err)
    if any(f == cell.field or f.startswith(cell.field + ".") for f in fields):
        return True
    # over the context: "... plus max_tokens (1000000) exceeds it" names it in its text
    return re.search(rf"(?<![\w.]){re.escape(cell.field)} \(", err["message"]) is not None


def check_cell(cell: Cell, r: httpx.Response) -> dict[str, Any] | None:
    """The invariants of one answer (module docstring); the error object (None for a 200)."""
    why = f"{cell}\n-> {r.status_code} {r.text[:500]}"
    if r.status_code == 200:
        assert cell.count_generates_nothing and cell.key not in (None, WRONG), why
        return None
    err = dialect_error(cell, r)
    if r.status_code == 429:
        assert cell.key == SPENT, why
        ra = r.headers.get("Retry-After")
        assert ra is not None and ra.isdigit() and 1 <= int(ra) <= 600, why
        return err
    assert r.status_code == cell.status, why
    if r.status_code == 400:
        if cell.field is None:  # not a JSON object: refused whole
            if cell.dialect == "openai":
                assert err["code"] == "invalid_json", why
            assert "JSON" in err["message"], why
        else:
            assert names_field(cell, err), why
    return err


# --- the servers ------------------------------------------------------------------------------
@dataclass
class Gateways:
    local: BackgroundServer
    proxy: BackgroundServer
    upstream: BackgroundServer
    engines: dict[str, FakeEngine]


def check_quiet(gw: Gateways) -> None:
    """Both engines idle with their pools whole; both client-facing gateways' admission and
    the keys' in-flight counts at 0."""
    for name, srv in (("local", gw.local), ("upstream", gw.upstream)):
        stats = wait_idle(srv, gw.engines[name])
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0, (name, stats)
        assert stats["kv_blocks_used"] == stats["pinned_blocks"] == 0, (name, stats)
    for srv in (gw.local, gw.proxy):
        state = srv.app[STATE]
        deadline = time.monotonic() + 5
        while True:
            adm = state.admission
            principals = [*state.keys._by_digest.values(), state.keys._anonymous]
            busy = [p.concurrent for p in principals if p.concurrent]
            quiet = adm.in_flight == 0 and adm.queued_requests == 0 and adm.queued_tokens == 0
            if (quiet and not busy) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert quiet, vars(adm)
        assert busy == []


@pytest.fixture(scope="module")
def gateways(tmp_path_factory) -> Iterator[Gateways]:
    """A keyed local gateway, and a keyed proxy in front of an open prefixgate upstream;
    the ``SPENT`` key's one request a minute already spent on both."""
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    engines: dict[str, FakeEngine] = {}

    def local(name: str, keys_file: str | None):
        def make():
            engines[name] = FakeEngine(token_delay_s=0.0, num_blocks=256)
            settings = GatewaySettings(
                model_name=MODEL, keys_file=keys_file, max_body_bytes=MAX_BODY
            )
            return create_app(engines[name], settings)

        return make

    with (
        BackgroundServer(local("local", str(keys))) as lsrv,
        BackgroundServer(local("upstream", None)) as usrv,
    ):
        settings = GatewaySettings(
            keys_file=str(keys), max_body_bytes=MAX_BODY, health_check_timeout_s=60.0
        )
        with BackgroundServer(lambda: create_proxy_app([usrv.url], settings)) as psrv:
            spend = Cell(CHAT, False, SPENT, "", json.dumps(base_body(CHAT, False)).encode())
            for srv in (lsrv, psrv):
                r = httpx.post(srv.url + CHAT, content=spend.content, headers=spend.headers())
                assert r.status_code == 200, r.text
            yield Gateways(lsrv, psrv, usrv, engines)
            for srv in (lsrv, usrv):
                srv.call(srv.app[LOCAL].engine.shutdown)


def test_every_guard_answers_alike_in_every_dialect_and_both_modes(gateways):
    @live_server_settings(EXAMPLES)
    @given(cells())
    def one(cell: Cell) -> None:
        answers = []
        with httpx.Client(timeout=30) as http:
            for srv in (gateways.local, gateways.proxy):
                r = http.post(srv.url + cell.path, content=cell.content, headers=cell.headers())
                answers.append((r.status_code, check_cell(cell, r)))
        (a, ea), (b, eb) = answers
        why = f"{cell}\nlocal {a} {ea}\nproxy {b} {eb}"
        if 429 in (a, b) and a != b:  # SPENT_KEY_ORDER: each mode's own order, for now
            assert cell.key == SPENT and (a, b) == (cell.status, 429), why
        else:
            assert a == b, why
            if a != 429:  # a 429's wait is each server's own
                assert ea == eb, why
        check_quiet(gateways)

    one()


def _gemini(path: str, field: str, value: Any) -> tuple[str, bytes, str]:
    body, wire = with_defect(path, base_body(path, False), field, value)
    return path, json.dumps(body).encode(), wire


# what the property test found (each was answered otherwise before its fix)
FOUND = [
    # Gemini's seed had no int64 bound: 2**63 served locally, a 400 through the proxy (which
    # sends it on as a chat's seed); past the engine's own bound, the engine's words naming
    # ``seed`` locally, the chat model's naming generationConfig.seed through the proxy; a
    # count took what generation refuses
    _gemini(GEN, "seed", I64),
    _gemini(GEN_STREAM, "seed", 2**64),
    _gemini(GEN, "seed", -I64 - 1),
    _gemini(GEN_COUNT, "seed", I64),
    # an empty Gemini stop sequence: the engine's "stop strings must not be empty" locally,
    # the chat model's "Value error, ..." through the proxy; a count took it
    _gemini(GEN, "stopSequences", [""]),
    _gemini(GEN_STREAM, "stopSequences", ["a", ""]),
    _gemini(GEN_COUNT, "stopSequences", [""]),
    # an empty body (the guard skips it; the route's model reads it): "Invalid JSON: EOF ..."
    # locally, "EOF ..." through the proxy
    (CHAT, b"", ""),
    (COMP, b"", ""),
]


@pytest.mark.parametrize(("path", "content", "field"), FOUND)
def test_what_the_cells_found_is_answered_alike(gateways, path, content, field):
    cell = Cell(path, False, OPEN, "found", content, field or None)
    with httpx.Client(timeout=30) as http:
        a, b = (
            http.post(srv.url + path, content=content, headers=cell.headers())
            for srv in (gateways.local, gateways.proxy)
        )
    assert a.status_code == 400, a.text
    assert (b.status_code, check_cell(cell, b)) == (a.status_code, check_cell(cell, a))
    check_quiet(gateways)


# A spent key (over its requests per minute) with a body local mode refuses: local mode
# judges the body first (its 400 names the field), the proxy admits first (429) and leaves
# the body to its upstream, which it never reaches. Not the same answer in both modes; kept
# as a strict xfail until one order serves both (the choices: docs/request-guards.md).
SPENT_KEY_ORDER = [
    (CHAT, {**base_body(CHAT, False), "n": 0}),
    (COMP, {**base_body(COMP, True), "stop": [""]}),
    (MSG, {**base_body(MSG, False), "max_tokens": BIG}),
    (GEN, with_defect(GEN, base_body(GEN, False), "maxOutputTokens", BIG)[0]),
]


@pytest.mark.xfail(strict=True, reason="a spent key beside a bad body: 400 local, 429 proxy")
@pytest.mark.parametrize(("path", "body"), SPENT_KEY_ORDER)
def test_a_spent_key_with_a_bad_body_gets_the_same_answer_in_both_modes(gateways, path, body):
    cell = Cell(path, False, SPENT, "spent", json.dumps(body).encode())
    spend = json.dumps(base_body(CHAT, False)).encode()
    with httpx.Client(timeout=30) as http:
        for srv in (gateways.local, gateways.proxy):  # spent now, however long the run took
            http.post(srv.url + CHAT, content=spend, headers=cell.headers())
        a, b = (
            http.post(srv.url + path, content=cell.content, headers=cell.headers())
            for srv in (gateways.local, gateways.proxy)
        )
    assert a.status_code == b.status_code, (a.text, b.text)
