"""The prompt-caching matrix: 3 dialects (chat completions, the Responses API, Anthropic's
Messages API) x 20 cases of cache controls and their edge values, on the real gateway and
aidreams-260k through the official ``openai`` and ``anthropic`` clients.

Each case either takes effect, shown by an observable (usage read / written tokens, the
engine pin and its TTL, the ``x-prefixgate-cache`` header, the diagnostics), or is a 400
naming the field; never silently ignored. Every answered request also holds the usage
invariant: read + written + uncached == the prompt's tokens, exactly, with the prompt
counted independently (``/v1/messages/count_tokens`` of the same conversation: the dialects
render the same token ids). One server for the module; the pool is whole at the end.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx
import openai
import pytest

pytest.importorskip("prefixgate.engine.async_engine")

from prefixgate.gateway.local.serving import LOCAL  # noqa: E402
from support.gateway import openai_client, serve_aidreams, wait_idle  # noqa: E402

MODEL = "aidreams"
BLOCK = 16
CHAT, RESPONSES, MESSAGES = "chat", "responses", "messages"
DIALECTS = (CHAT, RESPONSES, MESSAGES)
VERDICTS: dict[tuple[str, str], str] = {}  # (case, dialect) -> "effect" | "400"
CHECKED = [0]  # answers whose usage invariant was checked


@pytest.fixture(scope="module")
def server(aidreams_path):
    yield from serve_aidreams(aidreams_path, num_kv_blocks=512, model_name=MODEL)


@pytest.fixture(scope="module")
def clients(server):
    return (
        openai_client(server),
        anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0),
    )


def _system(tag: str) -> str:
    return f"[{tag}] " + "You are a friendly storyteller who tells short tales about animals. " * 2


# --- one request in any dialect ---------------------------------------------------------------
@dataclass
class Answer:
    """What one request got: ``status`` 200 or the error's; ``param`` the field an error names;
    usage normalized (``prompt``, ``read``, ``written``); the header; the raw body."""

    status: int
    param: str | None = None
    prompt: int = 0
    read: int = 0
    written: int = 0
    header: str | None = None
    body: dict[str, Any] = field(default_factory=dict)


@dataclass
class Conv:
    """A conversation in dialect-neutral form: the system text and its mark, the user parts
    (text, mark), tools (OpenAI function shape) with marks, top-level fields per dialect."""

    system: str
    system_mark: dict[str, Any] | None = None
    user: list[tuple[str, dict[str, Any] | None]] = field(
        default_factory=lambda: [("Tell me a story.", None)]
    )
    tools: list[tuple[dict[str, Any], dict[str, Any] | None]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    no_system: bool = False  # the system message comes from a prefix_id


def _tool(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "description": "Looks a word up in the animal dictionary. " * 3,
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
    }


def body_of(dialect: str, c: Conv) -> dict[str, Any]:
    """The request body of ``c`` in ``dialect`` (marks are the dialect's own spelling)."""
    if dialect == MESSAGES:
        system = [{"type": "text", "text": c.system, **(c.system_mark or {})}]
        user = [{"type": "text", "text": t, **(m or {})} for t, m in c.user]
        body: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": user}],
        }
        if not c.no_system:
            body["system"] = system
        if c.tools:
            body["tools"] = [
                {
                    "name": t["name"],
                    "description": t["description"],
                    "input_schema": t["parameters"],
                    **(m or {}),
                }
                for t, m in c.tools
            ]
            body["tool_choice"] = {"type": "tool", "name": c.tools[0][0]["name"]}
        return {**body, **c.extra}
    kind = "text" if dialect == CHAT else "input_text"
    system = [{"type": kind, "text": c.system, **(c.system_mark or {})}]
    user = [{"type": kind, "text": t, **(m or {})} for t, m in c.user]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    if c.no_system:
        messages = messages[1:]
    if dialect == CHAT:
        body = {"model": MODEL, "max_tokens": 2, "messages": messages}
        if c.tools:
            body["tools"] = [{"type": "function", "function": t, **(m or {})} for t, m in c.tools]
            body["tool_choice"] = {"type": "function", "function": {"name": c.tools[0][0]["name"]}}
    else:
        body = {"model": MODEL, "max_output_tokens": 2, "input": messages}
        if c.tools:
            body["tools"] = [{"type": "function", **t, **(m or {})} for t, m in c.tools]
    return {**body, **c.extra}


class Matrix:
    """Sends a ``Conv`` in one dialect through its official client and checks the usage."""

    def __init__(self, server, clients, dialect: str) -> None:
        self.server = server
        self.oai, self.ant = clients
        self.dialect = dialect

    # marks in the dialect's spelling
    def mark(self, ttl: str | None = None) -> dict[str, Any]:
        if self.dialect == MESSAGES:
            return {"cache_control": {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}}
        return {"prompt_cache_breakpoint": {"mode": "explicit", **({"ttl": ttl} if ttl else {})}}

    @property
    def long_ttl(self) -> tuple[str, float]:
        return ("1h", 3600.0) if self.dialect == MESSAGES else ("12h", 43_200.0)

    @property
    def default_ttl_s(self) -> float:
        return 300.0 if self.dialect == MESSAGES else 1800.0

    def send(self, c: Conv, stream: bool = False) -> Answer:
        body = body_of(self.dialect, c)
        try:
            answer = self._stream(body) if stream else self._whole(body)
        except (openai.BadRequestError, anthropic.BadRequestError) as exc:
            return self._error(exc)
        self.check_usage(c, answer)
        return answer

    def _whole(self, body: dict[str, Any]) -> Answer:
        if self.dialect == MESSAGES:
            b = dict(body)
            req = {k: b.pop(k) for k in ("model", "max_tokens", "messages")}
            raw = self.ant.messages.with_raw_response.create(**req, extra_body=b)
        elif self.dialect == CHAT:
            b = dict(body)
            req = {k: b.pop(k) for k in ("model", "messages")}
            raw = self.oai.chat.completions.with_raw_response.create(**req, extra_body=b)
        else:
            b = dict(body)
            raw = self.oai.responses.with_raw_response.create(model=b.pop("model"), extra_body=b)
        data = json.loads(raw.http_response.text)
        return self._usage(
            data["usage"], Answer(200, header=raw.headers.get("x-prefixgate-cache"), body=data)
        )

    def _stream(self, body: dict[str, Any]) -> Answer:
        b = dict(body)
        if self.dialect == MESSAGES:
            req = {k: b.pop(k) for k in ("model", "max_tokens", "messages")}
            with self.ant.messages.stream(**req, extra_body=b) as s:
                final = s.get_final_message()
            data = final.model_dump()
        elif self.dialect == CHAT:
            req = {k: b.pop(k) for k in ("model", "messages")}
            chunks = list(
                self.oai.chat.completions.create(
                    **req, stream=True, stream_options={"include_usage": True}, extra_body=b
                )
            )
            data = {"usage": chunks[-1].usage.model_dump()}
        else:
            events = list(
                self.oai.responses.create(model=b.pop("model"), stream=True, extra_body=b)
            )
            data = events[-1].response.model_dump()
        return self._usage(data["usage"], Answer(200, body=data))

    def _usage(self, u: dict[str, Any], a: Answer) -> Answer:
        if self.dialect == MESSAGES:
            a.read, a.written = u["cache_read_input_tokens"], u["cache_creation_input_tokens"]
            a.prompt = u["input_tokens"] + a.read + a.written
        elif self.dialect == CHAT:
            d = u["prompt_tokens_details"]
            a.prompt, a.read, a.written = (
                u["prompt_tokens"],
                d["cached_tokens"],
                d.get("cache_write_tokens") or 0,
            )
        else:
            d = u["input_tokens_details"]
            a.prompt, a.read, a.written = (
                u["input_tokens"],
                d["cached_tokens"],
                d["cache_write_tokens"],
            )
        return a

    def _error(self, exc: Any) -> Answer:
        body = exc.body if isinstance(exc.body, dict) else {}
        err = body.get("error", body) if isinstance(body.get("error"), dict) else body
        param = err.get("param")
        if param is None and self.dialect == MESSAGES:  # Anthropic names it in the message
            msg = str(err.get("message", "")).removeprefix(
                "Unrecognized request argument supplied: "
            )
            param = msg.split(":")[0]
        return Answer(exc.status_code, param=param, body=body)

    def check_usage(self, c: Conv, a: Answer) -> None:
        """read + written + uncached == the prompt, exactly; the prompt counted apart."""
        uncached = a.prompt - a.read - a.written
        assert uncached >= 0 and a.read >= 0 and a.written >= 0, a
        if self.dialect == MESSAGES:
            assert a.body["usage"]["input_tokens"] == uncached
        # (a prefix_id's system message is counted as the request's own)
        plain = Conv(
            c.system, user=[(t, None) for t, _ in c.user], tools=[(t, None) for t, _ in c.tools]
        )
        count = body_of(MESSAGES, plain)
        count.pop("max_tokens")
        r = httpx.post(self.server.url + "/v1/messages/count_tokens", json=count, timeout=30)
        assert r.status_code == 200, r.text
        assert a.prompt == r.json()["input_tokens"], (a, r.text)
        CHECKED[0] += 1

    # --- observables ------------------------------------------------------------------------
    def settle(self) -> None:
        self.server.call(self.server.app[LOCAL].cache_pins.settle)

    def pins(self) -> dict[Any, Any]:
        self.settle()
        pins = self.server.app[LOCAL].cache_pins
        pins._expire()
        return dict(pins._pins)

    def new_pins(self, before: dict[Any, Any]) -> list[Any]:
        return [p for k, p in self.pins().items() if k not in before]


def refused(a: Answer, param: str) -> str:
    assert a.status == 400, a
    assert a.param == param, a
    return "400"


# --- the 20 cases: each returns "effect" or "400" ---------------------------------------------
def case_prompt_cache_key(m: Matrix, tag: str) -> str:
    c = Conv(_system(tag), extra={"prompt_cache_key": "stories"})
    first = m.send(c)
    if m.dialect == MESSAGES:
        return refused(first, "prompt_cache_key")
    again = m.send(c)  # accepted: the prompt is prefix-cached as every prompt
    assert again.read >= again.prompt // BLOCK * BLOCK - BLOCK and again.read >= 64
    if m.dialect == RESPONSES:
        assert first.body["prompt_cache_key"] == "stories"
    return "effect"


def _implicit(m: Matrix, tag: str, extra: dict[str, Any], field_name: str, ttl_s: float) -> str:
    before = m.pins()
    a = m.send(Conv(_system(tag), extra=extra))
    if m.dialect == MESSAGES:
        return refused(a, field_name)
    assert a.written >= 64 and a.read == 0
    assert a.header.startswith(f"read=0; {field_name}={a.written}:written"), a.header
    pins = m.new_pins(before)
    assert [p.ttl_s for p in pins] == [ttl_s]
    if m.dialect == RESPONSES:  # the write is reported under the TTL it was written with
        split = a.body["usage"]["input_tokens_details"]["cache_write_tokens_details"]
        hours = f"ttl_{int(ttl_s) // 3600}h_tokens" if ttl_s % 3600 == 0 else None
        shown = hours or f"ttl_{int(ttl_s) // 60}m_tokens"
        assert split[shown] == a.written and sum(split.values()) == a.written, split
    return "effect"


def case_retention_24h(m, tag):
    return _implicit(m, tag, {"prompt_cache_retention": "24h"}, "prompt_cache_retention", 86_400.0)


def case_retention_in_memory(m, tag):
    before = m.pins()
    c = Conv(_system(tag), extra={"prompt_cache_retention": "in_memory"})
    a = m.send(c)
    if m.dialect == MESSAGES:
        return refused(a, "prompt_cache_retention")
    assert a.written == 0 and not m.new_pins(before)  # no pin: the plain prefix cache
    assert m.send(c).read >= 64
    return "effect"


def case_retention_invalid(m, tag):
    a = m.send(Conv(_system(tag), extra={"prompt_cache_retention": "forever"}))
    return refused(a, "prompt_cache_retention")


def case_options_implicit(m, tag):
    return _implicit(
        m, tag, {"prompt_cache_options": {"mode": "implicit"}}, "prompt_cache_options", 1800.0
    )


def case_options_explicit_without_marks(m, tag):
    before = m.pins()
    a = m.send(Conv(_system(tag), extra={"prompt_cache_options": {"mode": "explicit"}}))
    if m.dialect == MESSAGES:
        return refused(a, "prompt_cache_options")
    # explicit mode and no breakpoint: nothing written, nothing pinned (OpenAI: no caching)
    assert a.written == 0 and not m.new_pins(before)
    assert a.header == f"read={a.read}"
    return "effect"


def case_options_ttl_12h(m, tag):
    extra = {"prompt_cache_options": {"mode": "implicit", "ttl": "12h"}}
    if m.dialect == CHAT:  # chat's prompt_cache_options.ttl is "30m" only (openai's type)
        return refused(m.send(Conv(_system(tag), extra=extra)), "prompt_cache_options.ttl")
    return _implicit(m, tag, extra, "prompt_cache_options", 43_200.0)


def case_options_ttl_invalid(m, tag):
    a = m.send(Conv(_system(tag), extra={"prompt_cache_options": {"ttl": "1h"}}))
    if m.dialect == MESSAGES:
        return refused(a, "prompt_cache_options")
    return refused(a, "prompt_cache_options.ttl")


def _system_field(m: Matrix) -> str:
    if m.dialect == MESSAGES:
        return "system.0"
    root = "messages" if m.dialect == CHAT else "input"
    return f"{root}.0.content.0.prompt_cache_breakpoint"


def _explicit_only(m: Matrix) -> dict[str, Any]:
    return {} if m.dialect == MESSAGES else {"prompt_cache_options": {"mode": "explicit"}}


def case_system_breakpoint(m, tag):
    before = m.pins()
    a = m.send(Conv(_system(tag), system_mark=m.mark(), extra=_explicit_only(m)))
    assert a.written >= 64 and a.read == 0
    assert a.header == f"read=0; {_system_field(m)}={a.written}:written", a.header
    pins = m.new_pins(before)
    assert [p.ttl_s for p in pins] == [m.default_ttl_s]
    if m.dialect == MESSAGES:  # 5m is Anthropic's default TTL
        assert a.body["usage"]["cache_creation"]["ephemeral_5m_input_tokens"] == a.written
    return "effect"


def case_tools_breakpoint(m, tag):
    before = m.pins()
    mark = m.mark() if m.dialect == MESSAGES else {"cache_control": {"type": "ephemeral"}}
    a = m.send(Conv(_system(tag), tools=[(_tool("lookup"), mark)]))
    if m.dialect == RESPONSES:
        return refused(a, "tools")  # no tools on /v1/responses
    if m.dialect == CHAT:  # OpenAI's tools take no breakpoint: refused by name, not ignored
        return refused(a, "tools[0].cache_control")
    # aidreams' chat template renders no tools: the cut after the tools shares no whole
    # block with the prompt, and the header says so (nothing written, nothing pinned)
    assert a.header == f"read={a.read}; tools.0=0:below_one_block", a.header
    assert a.written == 0 and not m.new_pins(before)
    return "effect"


SHORT_SYSTEM = "Be brief."


def case_message_part_breakpoint(m, tag):
    before = m.pins()
    user = [(_system(tag), m.mark()), ("And make it short.", None)]
    a = m.send(Conv(SHORT_SYSTEM, user=user, extra=_explicit_only(m)))
    if m.dialect == MESSAGES:
        where = "messages.0.content.0"
    else:
        root = "messages" if m.dialect == CHAT else "input"
        where = f"{root}.1.content.0.prompt_cache_breakpoint"
    assert a.written >= 64 and f"{where}={a.written}:written" in a.header, a.header
    assert len(m.new_pins(before)) == 1
    # the same mark on the message rather than on its part: a 400 naming it, never ignored
    body = body_of(m.dialect, Conv(SHORT_SYSTEM, user=[(_system(tag), None)]))
    turn = body["messages" if m.dialect != RESPONSES else "input"][-1]
    turn.update(m.mark())
    r = httpx.post(m.server.url + "/v1/" + _ROUTES[m.dialect], json=body, timeout=30)
    root = "input" if m.dialect == RESPONSES else "messages"
    index = 0 if m.dialect == MESSAGES else 1
    assert r.status_code == 400 and f"{root}.{index}.{next(iter(m.mark()))}" in r.text, r.text
    return "effect"


_ROUTES = {CHAT: "chat/completions", RESPONSES: "responses", MESSAGES: "messages"}


def case_five_breakpoints(m, tag):
    user = [(f"Part {i}. ", m.mark()) for i in range(4)] + [("Fifth.", m.mark())]
    a = m.send(Conv(SHORT_SYSTEM, user=user))
    if m.dialect == MESSAGES:
        return refused(a, "messages.0.content.4.cache_control")
    root = "messages" if m.dialect == CHAT else "input"
    return refused(a, f"{root}.1.content.4.prompt_cache_breakpoint")


def case_breakpoint_ttl_long(m, tag):
    ttl, seconds = m.long_ttl
    before = m.pins()
    a = m.send(Conv(_system(tag), system_mark=m.mark(ttl), extra=_explicit_only(m)))
    assert a.written >= 64
    assert [p.ttl_s for p in m.new_pins(before)] == [seconds]
    if m.dialect == MESSAGES:
        assert a.body["usage"]["cache_creation"]["ephemeral_1h_input_tokens"] == a.written
    elif m.dialect == RESPONSES:
        assert a.body["usage"]["input_tokens_details"]["cache_write_tokens_details"] == {
            "ttl_12h_tokens": a.written,
            "ttl_30m_tokens": 0,
        }
    return "effect"


def case_breakpoint_ttl_invalid(m, tag):
    a = m.send(Conv(_system(tag), system_mark=m.mark("2h")))
    if m.dialect == MESSAGES:
        return refused(a, "system.0.cache_control.ttl")
    return refused(a, _system_field(m) + ".ttl")


def case_top_level_cache_control(m, tag):
    before = m.pins()
    a = m.send(Conv(_system(tag), extra={"cache_control": {"type": "ephemeral"}}))
    if m.dialect != MESSAGES:
        return refused(a, "cache_control")
    assert a.written >= 64 and a.header.startswith(f"read=0; cache_control={a.written}:written")
    assert len(m.new_pins(before)) == 1
    return "effect"


def case_below_one_block(m, tag):
    before = m.pins()
    a = m.send(Conv(tag[:4], system_mark=m.mark(), extra=_explicit_only(m)))
    assert a.written == 0 and a.header == f"read={a.read}; {_system_field(m)}=0:below_one_block"
    assert not m.new_pins(before)
    return "effect"


def case_repeat_read(m, tag):
    c = Conv(_system(tag), system_mark=m.mark(), extra=_explicit_only(m))
    first = m.send(c)
    m.settle()
    c.user = [("Another one.", None)]
    if m.dialect == MESSAGES:
        c.extra = {"diagnostics": {"previous_message_id": first.body["id"]}}
    elif m.dialect == RESPONSES:
        c.extra = {
            "prompt_cache_options": {"mode": "explicit", "comparison_response_id": first.body["id"]}
        }
    again = m.send(c)
    assert again.read >= first.written >= 64 and again.written == 0
    assert f"{_system_field(m)}={first.written}:hit" in again.header, again.header
    if m.dialect == MESSAGES:
        assert again.body["diagnostics"] == {"cache_miss_reason": None}
        assert "compare=hit" in again.header
    elif m.dialect == RESPONSES:
        assert again.body["prompt_cache_diagnostics"] == {"type": "cache_hit"}
    if m.dialect == CHAT:  # chat has no comparison field (openai's type): refused by name
        ask = Conv(
            c.system,
            c.system_mark,
            c.user,
            extra={
                "prompt_cache_options": {
                    "mode": "explicit",
                    "comparison_response_id": first.body["id"],
                }
            },
        )
        refused(m.send(ask), "prompt_cache_options.comparison_response_id")
    third = m.send(c)  # a third read: still a hit, still nothing written
    assert third.read == again.read and third.written == 0
    return "effect"


def case_salts_differ(m, tag):
    c = Conv(
        _system(tag), system_mark=m.mark(), extra={**_explicit_only(m), "cache_salt": "tenant-a"}
    )
    first = m.send(c)
    m.settle()
    c.extra = {**c.extra, "cache_salt": "tenant-b"}
    other = m.send(c)  # another partition: nothing read, the breakpoint written again
    assert first.written >= 64 and other.read == 0 and other.written == first.written
    c.extra = {**c.extra, "cache_salt": "tenant-a"}
    same = m.send(c)
    assert same.read >= first.written
    return "effect"


def case_prefix_id_with_breakpoint(m, tag):
    text = _system(tag)
    r = httpx.post(
        m.server.url + "/v1/prefixes",
        json={"model": MODEL, "messages": [{"role": "system", "content": text}]},
        timeout=30,
    )
    prefix = r.json()
    try:
        user = [("Tell me a story about a fox.", m.mark()), ("Short.", None)]
        extra = {**_explicit_only(m), "prefix_id": prefix["id"]}
        a = m.send(Conv(text, user=user, extra=extra, no_system=True))
        if m.dialect != CHAT:
            return refused(a, "prefix_id")
        # the prefix's pinned blocks: its tokens but the last (which may merge with what
        # follows, local/prefixes.py), so a 96-token prefix pins 5 whole blocks, not 6
        assert a.read >= (prefix["prompt_tokens"] - 1) // BLOCK * BLOCK >= 64
        marked = a.header.split("; ")[1]
        where, tokens_state = marked.split("=")
        tokens, state = tokens_state.split(":")
        assert where == "messages.0.content.0.prompt_cache_breakpoint", a.header
        # the mark covers the prefix and the marked part: read, then written past the read
        assert int(tokens) == a.read + a.written and state == ("written" if a.written else "hit")
        return "effect"
    finally:
        httpx.delete(m.server.url + f"/v1/prefixes/{prefix['id']}", timeout=30)


def case_stream_usage(m, tag):
    c = Conv(_system(tag), system_mark=m.mark(), extra=_explicit_only(m))
    streamed = m.send(c, stream=True)
    assert streamed.written >= 64 and streamed.read == 0
    m.settle()
    whole = m.send(c)
    s2 = m.send(c, stream=True)
    assert (s2.prompt, s2.read, s2.written) == (whole.prompt, whole.read, whole.written)
    assert whole.read >= streamed.written
    return "effect"


CASES: list[Callable[[Matrix, str], str]] = [
    case_prompt_cache_key,
    case_retention_24h,
    case_retention_in_memory,
    case_retention_invalid,
    case_options_implicit,
    case_options_explicit_without_marks,
    case_options_ttl_12h,
    case_options_ttl_invalid,
    case_system_breakpoint,
    case_tools_breakpoint,
    case_message_part_breakpoint,
    case_five_breakpoints,
    case_breakpoint_ttl_long,
    case_breakpoint_ttl_invalid,
    case_top_level_cache_control,
    case_below_one_block,
    case_repeat_read,
    case_salts_differ,
    case_prefix_id_with_breakpoint,
    case_stream_usage,
]


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("case", CASES, ids=[f.__name__.removeprefix("case_") for f in CASES])
def test_cache_control_takes_effect_or_is_a_400(server, clients, case, dialect):
    m = Matrix(server, clients, dialect)
    verdict = case(m, uuid.uuid4().hex[:8])
    assert verdict in ("effect", "400")
    VERDICTS[(case.__name__, dialect)] = verdict
    m.settle()
    server.app[LOCAL].cache_pins.clear()  # each case starts from no breakpoint pin


def test_matrix_figure_and_pool_whole(server, pool_whole):
    if len(VERDICTS) < len(CASES) * len(DIALECTS):
        pytest.skip("the figure needs the whole matrix")
    effect = sum(v == "effect" for v in VERDICTS.values())
    assert CHECKED[0] >= effect  # every case that took effect had its usage checked
    print(
        f"\ncache matrix: {CHECKED[0]} answers with read + written + uncached == prompt; {len(VERDICTS)} cases, {effect} take effect, {len(VERDICTS) - effect} are 400s"
    )
    server.app[LOCAL].cache_pins.clear()
    wait_idle(server, pool_whole)
