"""Request headers read as text, safely.

aiohttp decodes header bytes as UTF-8 with ``surrogateescape``: a byte that is not UTF-8
becomes a lone surrogate (``"\\udcff"``), which fails later, far from the header, when the text
is hashed, logged or forwarded (``UnicodeEncodeError``, a 500). Every header the gateway reads
goes through ``header_text``, so such bytes are one 400 ``invalid_header`` naming the header
(``Expect`` is answered before any route: anything but ``100-continue``, undecodable bytes
included, is its 417, ``errors.expect_continue``).
"""

from __future__ import annotations

from aiohttp import web
from prefixgate.gateway.http.errors import APIError


def header_text(request: web.Request, name: str, default: str = "") -> str:
    """The value of header ``name`` (``default`` when absent), guaranteed valid UTF-8.

    Raises:
        APIError: 400 ``invalid_header`` (``param`` = the header's name) when its bytes are not
            UTF-8.
    """
    value = request.headers.get(name)
    if value is None:
        return default
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(
            400,
            f"the {name} header is not valid UTF-8",
            param=name,
            code="invalid_header",
        ) from None
    return value
