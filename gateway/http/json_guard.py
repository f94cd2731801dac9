"""The ingress guard: every JSON request body is bounded once, before any route parses it.

``json_guard_middleware`` runs inside ``body_limits_middleware`` (the body is read, at most
``max_body_bytes``) and before every handler of both apps: a route added later, of any
dialect, is guarded without a line of its own. It parses the body once with the JSON parser
(jiter, through ``pydantic_core.from_json``; Rust, no Python recursion) and walks the parsed
value iteratively (no recursion either), stopping at the first bound passed:

* nesting: at most ``MAX_JSON_DEPTH`` (200) levels of arrays/objects, the parser's own limit;
* an array of anything but numbers: at most ``MAX_ARRAY_ITEMS`` (4,096) items; an object at
  most ``MAX_ARRAY_ITEMS`` members;
* an array of numbers (token ids) in a field that takes them (``TOKEN_ID_FIELDS``:
  completions' ``prompt``, embeddings' ``input``, ``/detokenize``'s ``tokens``, vLLM's token-id
  lists) or inside another array (a batch: ``prompt: [[ids], ...]``): at most ``MAX_TOKEN_IDS``
  (1,048,576) items; numbers anywhere else count as any other items (a model that expects
  objects there validates each of them, one error apiece: ``"messages": [1, 1, ...]`` of a
  million numbers held the event loop for ~10 s and grew the server by hundreds of MB);
* the whole body: at most ``MAX_JSON_VALUES`` (131,072; ``--max-request-values``) values
  other than numbers (objects, arrays, strings, object keys, booleans, nulls: what request
  models validate one by one); a body whose quotes alone show more strings is refused before
  it is parsed;
* fields of every dialect with a bound of their own (``FIELD_LIMITS``, by name, at any depth):
  ``messages`` / ``input`` / ``contents`` 4,096 (``too_many_messages``), ``tools`` and
  ``functionDeclarations`` 128 (``too_many_tools``, OpenAI's bound; ``--max-request-tools``).

A body past a bound is a 400 (``invalid_json`` for malformed or too deep JSON,
``too_many_messages`` / ``too_many_tools`` / ``too_many_items`` / ``too_many_values``) with
``param`` the path of the array at fault (a string that is not Unicode, a lone surrogate
``"\\ud800"`` or bytes that are not UTF-8: ``invalid_json`` saying so, ``param`` its path:
``unicode_error``), in the error object of the route's dialect
(``errors.dialect_of``). Bodies over ``OFFLOAD_BYTES`` are checked in a worker thread so the
event loop keeps serving others meanwhile. A handler that never reads its body (the
fallback route's 404/405, upstream mode's 501) is marked ``no_body`` and skipped.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

import pydantic_core
from aiohttp import web
from prefixgate.gateway.http.errors import APIError, Handler, bad_request

MAX_JSON_DEPTH = 200  # nesting of a body's arrays/objects: the JSON parser's recursion limit
MAX_MESSAGES = 4096  # messages (or input items, turns) of one request
MAX_ARRAY_ITEMS = 4096  # items of an array of non-numbers, members of an object
MAX_TOKEN_IDS = 1_048_576  # items of an array of numbers (token ids)
MAX_JSON_VALUES = 131_072  # values other than numbers in one body
MAX_TOOLS = 128  # tools of one request (OpenAI's bound)
OFFLOAD_BYTES = 64 * 1024  # bodies larger than this are checked in a worker thread
# Fields whose array may hold more than MAX_ARRAY_ITEMS numbers (token ids), wherever they are.
TOKEN_ID_FIELDS = frozenset(
    (
        "prompt",  # completions
        "input",  # embeddings
        "tokens",  # /detokenize
        "prompt_token_ids",
        "stop_token_ids",  # vLLM's sampling fields
        "allowed_token_ids",
        "bad_words_token_ids",
    )
)

# Field name -> what its array holds (its bound and error code: ``Limits``), wherever the
# field is: one table for every dialect (OpenAI's chat/prefixes/tokenize ``messages``,
# Responses' ``input``, Anthropic's ``messages``, Gemini's ``contents``; tools of each).
FIELD_LIMITS: dict[str, str] = {
    "messages": "messages",
    "input": "messages",
    "contents": "messages",
    "tools": "tools",
    "functionDeclarations": "tools",
    "function_declarations": "tools",
}


@dataclass(frozen=True, slots=True)
class Limits:
    """The guard's bounds that ``prefixgate serve`` sets (``--max-request-tools``,
    ``--max-request-values``); the others are constants of the module."""

    max_tools: int = MAX_TOOLS
    max_values: int = MAX_JSON_VALUES

    def of(self, kind: str) -> tuple[int, str]:
        """``(bound, error code)`` of a ``FIELD_LIMITS`` kind."""
        if kind == "tools":
            return self.max_tools, "too_many_tools"
        return MAX_MESSAGES, "too_many_messages"


LIMITS = Limits()

GUARD_LIMITS: web.AppKey[Limits] = web.AppKey("prefixgate_guard_limits", Limits)

_BODY_METHODS = frozenset(("POST", "PUT", "PATCH"))
_CONTAINERS = (dict, list)
_NUMBERS = (int, float)


def no_body(handler: Handler) -> Handler:
    """Mark a handler that never reads its body: the guard leaves its requests alone."""
    handler.no_body = True  # type: ignore[attr-defined]
    return handler


def load_json(body: bytes | str) -> Any:
    """A body parsed to Python values (``dict``, ``list``, ``str``, ``int``, ``float``,
    ``bool``, ``None``), nesting bounded by ``MAX_JSON_DEPTH``.

    Raises:
        APIError: 400 ``invalid_json`` for malformed JSON or JSON nested deeper than
            ``MAX_JSON_DEPTH`` (never a ``RecursionError``).
    """
    try:
        return pydantic_core.from_json(body)
    except ValueError as exc:
        raise json_error(str(exc), body) from None


_SURROGATE_FAULTS = ("unexpected end of hex escape", "lone leading surrogate")
_AT = re.compile(r" at (line \d+ column \d+)$")
_PYDANTIC_HEAD = "Invalid JSON: "  # what a model's ``model_validate_json`` puts first


def json_error(msg: str, body: bytes | str | None = None) -> APIError:
    """The 400 ``invalid_json`` for the JSON parser's message ``msg`` about ``body``: a body
    nested past ``MAX_JSON_DEPTH`` is well-formed JSON and is told so (its depth, not
    "malformed"); a string that is not Unicode is told as what it is and where
    (``unicode_error``), not in the parser's words ("unexpected end of hex escape"). The
    message is the same whichever parser read the body (the guard's, or a route's model
    reading a body the guard skips: an empty one)."""
    if body is not None and (
        any(fault in msg for fault in _SURROGATE_FAULTS) or "invalid unicode code point" in msg
    ):
        return unicode_error(msg, body)
    msg = msg.removeprefix(_PYDANTIC_HEAD)  # the same words whichever parser read the body
    if "recursion limit" in msg:
        return bad_request(
            f"JSON body nested deeper than {MAX_JSON_DEPTH} levels of arrays and objects, "
            f"the bound of every route ({msg})",
            code="invalid_json",
        )
    return bad_request(f"malformed JSON body: {msg}", code="invalid_json")


def unicode_error(msg: str, body: bytes | str) -> APIError:
    """The 400 ``invalid_json`` for a body the JSON parser refused as not Unicode (its message
    ``msg``): a lone UTF-16 surrogate escape (``"\\ud800"``: JSON's ``\\u`` escapes can spell
    one, Unicode has no such character; a high ``\\ud800``-``\\udbff`` must be followed by a
    low ``\\udc00``-``\\udfff``), or bytes that are not UTF-8. ``param`` is the dotted path
    of the first string (value or key) at fault, found by re-reading the body with Python's
    JSON parser, which keeps lone surrogates (None when that fails too: the message then
    gives the parser's line and column only)."""
    found = _AT.search(msg)
    at = f" at {found.group(1)}" if found else ""
    utf8 = "invalid unicode code point" in msg
    text = body.decode("utf-8", "surrogateescape") if isinstance(body, bytes) else body
    try:
        where, char = _first_surrogate(json.loads(text))
    except (ValueError, RecursionError):
        where, char = None, None
    head = f"{where}: " if where else ""
    if utf8:
        return bad_request(
            f"{head}the body is not valid UTF-8{at}: JSON text must be UTF-8",
            param=where,
            code="invalid_json",
        )
    escape = f" \\u{ord(char):04x}" if char else ""
    return bad_request(
        f"{head}lone surrogate{escape}{at}: not valid Unicode (a UTF-16 surrogate escape must "
        "be a high \\ud800-\\udbff followed by a low \\udc00-\\udfff)",
        param=where,
        code="invalid_json",
    )


def _first_surrogate(value: Any) -> tuple[str | None, str | None]:
    """``(dotted path, character)`` of the first string (value or object key, in document
    order) of a parsed body holding a surrogate code point (a lone one: a pair is decoded to
    one character), walked without recursion; ``(None, None)`` when none does."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            bad = _SURROGATE.search(node)
            if bad is not None:
                return ".".join(path) or None, bad.group()
        elif isinstance(node, dict):
            for key in node:  # a key is read before its value
                bad = _SURROGATE.search(key)
                if bad is not None:
                    return ".".join(path) or None, bad.group()
            stack += [(v, (*path, k)) for k, v in reversed(list(node.items()))]
        elif isinstance(node, list):
            stack += [(v, (*path, str(i))) for i, v in reversed(list(enumerate(node)))]
    return None, None


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_body(body: bytes, limits: Limits = LIMITS) -> Any:
    """Parse ``body`` and check every bound of the module docstring; the parsed value.

    Cost: a count of the body's quotes (a lower bound of its strings: more than
    ``MAX_JSON_VALUES`` is refused without parsing), then one parse and one step per
    object/array member until a bound is passed (at most ``MAX_JSON_VALUES`` containers and
    strings, plus the items of number arrays).

    Raises:
        APIError: 400 naming the path of the value at fault (``param``).
    """
    if len(body) > 2 * limits.max_values:
        # Each string (or key) has two quotes that are not escaped: a lower bound of the
        # strings, counted without parsing (a 4 MB body of tiny blocks is refused in
        # milliseconds, before its million objects are built).
        strings = (body.count(b'"') - body.count(b'\\"')) // 2
        if strings > limits.max_values:
            raise _too_many_values(limits, f" (at least {strings} strings)")
    value = load_json(body)
    check_value(value, limits)
    return value


def check_value(value: Any, limits: Limits = LIMITS) -> None:
    """Check a parsed body's counts (``check_body`` without the parse).

    Raises:
        APIError: 400 ``too_many_messages``, ``too_many_tools``, ``too_many_items`` or
            ``too_many_values`` with ``param`` the dotted path of the container at fault.
    """
    # (container, its key in its parent, index of its parent in `parents`): paths are built
    # only for an error
    if type(value) is not dict and type(value) is not list:
        return  # a scalar body: the route's model refuses it
    parents: list[tuple[int, str | int]] = []
    stack: list[tuple[Any, str | int, int]] = [(value, "", -1)]
    values = 0
    while stack:
        node, key, parent = stack.pop()
        here = len(parents)
        parents.append((parent, key))
        n = len(node)
        values += 1
        if isinstance(node, dict):
            if n > MAX_ARRAY_ITEMS:
                raise _too_many(parents, here, "members", n, MAX_ARRAY_ITEMS, "too_many_items")
            values += n  # the keys
            items: Any = node.items()
        else:
            kind = FIELD_LIMITS.get(key) if isinstance(key, str) else None
            limit = limits.of(kind) if kind is not None else None
            if n > MAX_ARRAY_ITEMS or (limit is not None and n > limit[0]):
                ids = not isinstance(key, str) or key in TOKEN_ID_FIELDS  # a batch's item: int key
                if ids and all(type(x) in _NUMBERS for x in node):
                    if n > MAX_TOKEN_IDS:
                        raise _too_many(
                            parents, here, "numbers", n, MAX_TOKEN_IDS, "too_many_items"
                        )
                    continue
                bound, code = limit if limit is not None else (MAX_ARRAY_ITEMS, "too_many_items")
                raise _too_many(parents, here, "items", n, min(bound, MAX_ARRAY_ITEMS), code)
            items = enumerate(node)
        for k, x in items:
            t = type(x)
            if t is dict or t is list:
                stack.append((x, k, here))
            elif t is not int and t is not float:
                values += 1
        if values > limits.max_values:
            raise _too_many_values(limits)


def _too_many_values(limits: Limits, seen: str = "") -> APIError:
    return APIError(
        400,
        f"the body holds more than {limits.max_values} values other than numbers (objects, "
        f"arrays, strings, object keys, booleans, nulls), the bound of every route{seen}",
        code="too_many_values",
    )


def _too_many(
    parents: list[tuple[int, str | int]], at: int, what: str, n: int, bound: int, code: str
) -> APIError:
    kind = "object" if what == "members" else "array"
    path: list[str] = []
    while at > 0:
        at, key = parents[at]
        path.append(str(key))
    param = ".".join(reversed(path)) or None
    where = param or "the body"
    per = "per request" if code in ("too_many_messages", "too_many_tools") else f"per {kind}"
    return bad_request(f"{where}: at most {bound} {what} {per}, got {n}", param=param, code=code)


@web.middleware
async def json_guard_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse a body past the module's bounds before ``handler`` runs (a 400 in the route's
    dialect, raised to ``error_middleware``)."""
    if request.method in _BODY_METHODS and request.body_exists:
        route_handler = getattr(request.match_info, "handler", None)
        if not getattr(route_handler, "no_body", False):
            body = await request.read()
            limits = request.app[GUARD_LIMITS]
            if len(body) > OFFLOAD_BYTES:
                await asyncio.to_thread(check_body, body, limits)
            elif body:
                check_body(body, limits)
    return await handler(request)


__all__ = [
    "FIELD_LIMITS",
    "GUARD_LIMITS",
    "LIMITS",
    "Limits",
    "MAX_ARRAY_ITEMS",
    "MAX_JSON_DEPTH",
    "MAX_JSON_VALUES",
    "MAX_MESSAGES",
    "MAX_TOKEN_IDS",
    "MAX_TOOLS",
    "check_body",
    "check_value",
    "json_error",
    "json_guard_middleware",
    "load_json",
    "no_body",
    "unicode_error",
]
