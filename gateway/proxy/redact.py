"""Upstream errors reworded, never relayed: no upstream credential ever reaches a client.

An upstream's error body is written by another server, about the request the *gateway* sent:
with the gateway's own credential (``--upstream-api-key``, or a URL's ``user:password``), a 401
or 403 is about that credential, and some servers quote it ("Incorrect API key provided:
Bearer sk-..."). So:

* ``auth_error(status, up, own)``: a 401/403 answered to the gateway's own credential is a 502
  ``upstream_auth_failed`` naming the upstream (its URL, which never holds a password), never
  its body; answered to the client's own forwarded ``Authorization`` (an open gateway without
  an upstream key) it stays a 401/403, reworded, the body still not shown.
* ``reworded_error(data, secrets)``: any other error body is rebuilt as an OpenAI error object
  of its four fields (``message``, ``type``, ``param``, ``code``; anything else dropped) with
  every credential string replaced by ``[redacted]``.
* ``upstream_error(status, data, headers, secrets, fields)``: the one rewording every
  dialect uses: the client's ``APIError`` for an upstream's error answer (OpenAI's, vLLM's,
  Anthropic's, FastAPI's shapes: ``reworded_error``), which each dialect writes as its own
  error object (``APIError.body`` / ``anthropic_body`` / ``gemini_body``); a translated
  request's chat fields named as the client sent them (``in_client_words``, ``fields``: the
  dialect's ``wire.client_fields.ClientFields``). A body without an error object
  (an HTML page, a traceback, nothing) is never shown: a generic message. A 400 saying the
  prompt exceeds the context (OpenAI's code, vLLM's and SGLang's wording, ``too_long``) has
  the code ``context_length_exceeded``.
* ``secrets_of(api_key, up)``: the strings to scrub: the key, its ``Bearer`` header, a URL's
  Basic header, its base64 token, ``user:password`` and the password alone.
* ``scrub(data, secrets)``: the same replacement on raw bytes (stream events).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any

from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.wire.client_fields import ClientFields, in_client_words

REDACTED = "[redacted]"
_MIN_SECRET = 4  # shorter strings are not scrubbed (they would garble every message)


def secrets_of(api_key: str | None, auth: str | None) -> tuple[str, ...]:
    """Every spelling of the gateway's upstream credentials (longest first): ``api_key`` (and
    ``Bearer <key>``), an upstream's own ``auth`` header value (``Basic <token>``), its token
    and the ``user:password`` / password it encodes."""
    found: set[str] = set()
    if api_key:
        found |= {api_key, "Bearer " + api_key}
    if auth:
        found.add(auth)
        scheme, _, token = auth.partition(" ")
        if token:
            found.add(token)
            if scheme.lower() == "basic":
                try:
                    userinfo = base64.b64decode(token, validate=True).decode("utf-8")
                except (binascii.Error, UnicodeDecodeError):
                    userinfo = ""
                if userinfo:
                    found.add(userinfo)
                    found.add(userinfo.partition(":")[2])
    return tuple(sorted((s for s in found if len(s) >= _MIN_SECRET), key=len, reverse=True))


def scrub_text(text: str, secrets: tuple[str, ...]) -> str:
    """``text`` with every secret replaced by ``[redacted]``."""
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def scrub(data: bytes, secrets: tuple[str, ...]) -> bytes:
    """``data`` (UTF-8 bytes, e.g. stream events) with every secret replaced, also in its
    JSON-escaped spelling."""
    for secret in secrets:
        for spelled in {secret, json.dumps(secret)[1:-1]}:
            raw = spelled.encode("utf-8", "surrogatepass")
            if raw in data:
                data = data.replace(raw, REDACTED.encode())
    return data


def auth_error(status: int, url: str, own_credential: bool) -> APIError:
    """The error for an upstream's 401/403 (its body never shown).

    Returns:
        502 ``upstream_auth_failed`` naming ``url`` when the gateway sent its own credential;
        else ``status`` with ``invalid_api_key`` (the client's forwarded key was refused).
    """
    if own_credential:
        return APIError(
            502,
            f"upstream {url} refused the gateway's credentials (HTTP {status}): check "
            "--upstream-api-key or the upstream URL's user:password",
            code="upstream_auth_failed",
            type="upstream_error",
        )
    return APIError(
        status,
        f"upstream {url} refused the request's credentials (HTTP {status})",
        code="invalid_api_key",
    )


def reworded_error(data: bytes, secrets: tuple[str, ...]) -> dict[str, Any] | None:
    """An upstream's error body (decoded: the upstream session undoes its ``Content-Encoding``)
    rebuilt as an OpenAI error object of its four fields, credentials scrubbed; None when
    ``data`` is no error body this knows.

    The shapes read (``upstream_error_fields``): OpenAI's ``{"error": {message, type, param,
    code}}`` (Anthropic's ``{"type": "error", "error": {type, message}}`` too), vLLM's flat
    ``{"object": "error", "message", "type", "param", "code"}``, FastAPI's validation
    ``{"detail": [{"loc": ["body", FIELD, ...], "msg"}]}`` or ``{"detail": "text"}``, and
    ``{"error": "text"}``. A ``param`` the body leaves null is read off a message that starts
    with a request field, ``temperature: ...`` (how prefixgate and many servers word it; FastAPI's ``loc`` as local
    mode spells it, ``messages.0.role``), so
    a semantic 400 names its field in proxy mode as in local mode. A non-string ``code``
    (vLLM sends the HTTP status) is dropped.
    """
    try:
        parsed = json.loads(data)
    except (ValueError, RecursionError):
        return None
    err = upstream_error_fields(parsed)
    if err is None:
        return None

    def field(name: str) -> str | None:
        value = err.get(name)
        if value is None:
            return None
        text = value if isinstance(value, str) else json.dumps(value)
        return scrub_text(text, secrets)[:2000]

    message = field("message") or "upstream error"
    code = err.get("code")
    return {
        "error": {
            "message": message,
            "type": field("type") or "upstream_error",
            "param": field("param") or param_of(message),
            "code": field("code") if isinstance(code, str) else None,
        }
    }


def upstream_error_fields(parsed: Any) -> dict[str, Any] | None:
    """The error fields of a parsed upstream error body in any shape ``reworded_error``
    reads, or None."""
    if not isinstance(parsed, dict):
        return None
    err = parsed.get("error")
    if isinstance(err, dict):
        return err
    if isinstance(err, str):
        return {"message": err}
    if parsed.get("object") == "error" and isinstance(parsed.get("message"), str):
        return parsed
    detail = parsed.get("detail")
    if isinstance(detail, str):
        return {"message": detail}
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):
        first = detail[0]
        loc = [str(p) for p in first.get("loc") or [] if p != "body"]
        where = ".".join(loc)  # local mode's spelling: messages.0.role
        msg = str(first.get("msg") or "invalid value")
        return {
            "message": f"{where}: {msg}" if where else msg,
            "type": "invalid_request_error",
            "param": where or None,
        }
    return None


_LEADING_FIELD = re.compile(r"^([A-Za-z_]\w*)((?:\.\w+|\[\d+\])*)\s*:\s")


def param_of(message: str) -> str | None:
    """The request field a message starts with (``"temperature: must be ..."`` →
    ``"temperature"``, ``"messages.0.role: ..."`` → ``"messages.0.role"``) when its first
    name is a field of OpenAI's chat or completions requests (``wire.request_fields``), else
    None."""
    from prefixgate.gateway.wire.request_fields import known_fields  # noqa: PLC0415

    found = _LEADING_FIELD.match(message)
    if found is None or found.group(1) not in known_fields():
        return None
    return found.group(1) + found.group(2)


def upstream_error(
    status: int,
    data: bytes,
    headers: Any,
    secrets: tuple[str, ...],
    fields: ClientFields | None = None,
) -> APIError:
    """The client's error for an upstream's error answer (``status`` >= 400, body ``data``,
    its ``headers``), the one rewording of every dialect (each writes it as its own error
    object): the upstream's wait (``retry-after-ms``, else ``Retry-After``) kept, and

    * a 4xx (the request's own fault: a field, a limit, the context, a rate limit): the error
      object's four fields with ``secrets`` scrubbed (``reworded_error``), so a semantic 400
      names its field as local mode does; a prompt over the context is
      ``context_length_exceeded`` (``too_long``); when the relay translated the client's
      request (``fields``: Messages or Gemini sent as a chat body), its ``param`` and the
      field paths in its message are the client's own (``in_client_words``);
    * a 5xx (the upstream's own fault, whose words may name its insides: hosts, paths,
      shards): the gateway's words, ``the upstream answered HTTP 503 (type, code)``, the
      upstream's type and code only when they are identifiers holding no secret;
    * a body without an error object (an HTML page, a traceback, nothing): never shown.

    A status under 400 is answered 502.
    """
    shown = status if status >= 400 else 502
    wait = retry_after(headers)
    error = reworded_error(data, secrets)
    if error is None:
        return APIError(
            shown,
            f"the upstream answered HTTP {status} without an error object",
            code="upstream_error",
            retry_after=wait,
        )
    e = error["error"]
    code = e["code"]
    if status == 400 and too_long(data, headers):
        code = "context_length_exceeded"
    if shown < 500:
        err = APIError(
            shown, e["message"], param=e["param"], code=code, type=e["type"], retry_after=wait
        )
        return err if fields is None else in_client_words(err, fields)
    named = [w for w in (e["type"], code) if isinstance(w, str) and _identifier(w, secrets)]
    said = f" ({', '.join(dict.fromkeys(named))})" if named else ""
    return APIError(
        shown,
        f"the upstream answered HTTP {status}{said}",
        code=code if isinstance(code, str) and _identifier(code, secrets) else "upstream_error",
        type=e["type"] if _identifier(e["type"], secrets) else None,
        retry_after=wait,
    )


_IDENTIFIER = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")


def _identifier(word: str, secrets: tuple[str, ...]) -> bool:
    """Whether an upstream's error type or code may be named: an identifier holding none of
    the gateway's upstream credentials (nor the ``[redacted]`` left of one)."""
    return bool(_IDENTIFIER.fullmatch(word)) and not any(s in word for s in secrets)


def retry_after(headers: Any) -> float | None:
    """The upstream's wait in seconds: its ``retry-after-ms`` (the finer one) when a whole
    number, else its ``Retry-After`` when a whole number, else None."""
    ms = headers.get("retry-after-ms", "")
    if ms.isdigit():
        return int(ms) / 1000.0
    retry = headers.get("Retry-After", "")
    return float(retry) if retry.isdigit() else None


def too_long(data: bytes, headers: Any) -> bool:
    """True when an upstream's 400 body says the prompt exceeds the model's context
    (OpenAI's code ``context_length_exceeded``, or vLLM's / SGLang's "maximum context
    length" message)."""
    err = error_object(data, headers)
    if err is None:
        return False
    message = err.get("message")
    return err.get("code") == "context_length_exceeded" or (
        isinstance(message, str) and "maximum context length" in message
    )


def error_object(data: bytes, headers: Any) -> dict[str, Any] | None:
    """The ``error`` object of an upstream's JSON error body; None when the body is not JSON
    or holds no error object."""
    try:
        err = json.loads(data).get("error")
    except (ValueError, AttributeError):
        return None
    return err if isinstance(err, dict) else None
