"""``x-request-id`` on every response: the client's own id when it sent a usable one, else a
fresh one (as OpenAI's API and vLLM's server answer), so a client can quote it in a report and
an operator can find the request in the access log.

A client id is kept when it is 1–128 characters of ``[A-Za-z0-9._:-]`` (safe in a header and
a log line); anything else is replaced, never echoed.
"""

from __future__ import annotations

import re
import uuid

from aiohttp import web

HEADER = "x-request-id"
_SAFE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
KEY = web.RequestKey("prefixgate_request_id", str)


def request_id(request: web.Request) -> str:
    """The request's id (the client's usable ``x-request-id``, else a new uuid4 hex); the same
    value for every call on one request."""
    rid = request.get(KEY)
    if rid is None:
        sent = request.headers.get(HEADER, "")
        # the pattern is ASCII: a value with bytes that are not UTF-8 never matches
        rid = sent if _SAFE.fullmatch(sent) else uuid.uuid4().hex
        request[KEY] = rid
    return rid


async def stamp(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare`` hook: set the header on every answer, streams and errors
    included (it runs before the headers are sent)."""
    response.headers[HEADER] = request_id(request)
