"""Upstream URLs: the form that may be shown (no userinfo) and the credential a URL carries.

Apart from the pool (``proxy.upstream``) so that what only names upstreams (the KV event
feeds of ``--upstream-kv-events``, a routing policy) needs none of it.
"""

from __future__ import annotations

import aiohttp
import yarl


def normalize_url(url: str) -> str:
    """``http://host:port`` from ``http://host:port/``, ``.../v1`` or ``.../v1/``, without
    any ``user:password@`` (see ``split_credentials``): the URL that may be shown.

    Raises:
        ValueError: when the URL is not http(s)://[user[:password]@]host[:port][/v1].
    """
    return split_credentials(url)[0]


def split_credentials(url: str) -> tuple[str, str | None]:
    """``(normalized URL without userinfo, "Basic ..." Authorization value or None)``.

    Userinfo in an upstream URL (``http://user:pass@host``) is turned into an HTTP Basic
    ``Authorization`` header once, here (RFC 7617: base64 of ``user:password``, both
    percent-decoded), and never shown: ``/ready``, ``/metrics`` labels and logs use the URL
    without it.

    Raises:
        ValueError: when the URL is not http(s)://[user[:password]@]host[:port][/v1]
            (the message never repeats the password).
    """
    u = url.strip().rstrip("/")
    if u.endswith("/v1"):
        u = u[:-3]
    try:
        parsed = yarl.URL(u)
        host = parsed.host
        port = parsed.explicit_port
    except ValueError:
        parsed, host, port = None, None, None
    if (
        parsed is None
        or parsed.scheme not in ("http", "https")
        or not host
        or parsed.path not in ("", "/")
        or parsed.query_string
        or parsed.fragment
    ):
        shown = url if "@" not in url else "<redacted>@" + url.rsplit("@", 1)[1]
        raise ValueError(f"upstream URL must look like http://host:port[/v1], got {shown!r}")
    auth = None
    if parsed.user is not None or parsed.password is not None:
        auth = aiohttp.BasicAuth(parsed.user or "", parsed.password or "").encode()
    bare = f"{parsed.scheme}://{parsed.raw_host if ':' not in host else '[' + host + ']'}"
    if port is not None:
        bare += f":{port}"
    return bare, auth
