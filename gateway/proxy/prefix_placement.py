"""Placing a proxy-mode prefix on an upstream (see ``proxy_prefixes`` for the registry).

The upstream for a prefix is the one routing picks for the prefix's own text and cache salt
(``route``), so the prefix sits where requests starting with it go anyway. A prefixgate
upstream (``Upstream.prefix_api``) gets it through its own ``POST /v1/prefixes``, with the
effective cache salt as ``cache_salt``; the next upstream is tried when one fails. On any other
upstream nothing is registered: the text stays with the gateway and its tokens are counted by
the upstream's ``POST /tokenize`` where it has one. ``release`` deletes an upstream pin (best
effort: an unreachable upstream releases it at the TTL).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
from prefixgate.gateway.proxy.policies import Route
from prefixgate.gateway.proxy.redact import auth_error, secrets_of, upstream_error
from prefixgate.gateway.proxy.upstream import Upstream, UpstreamRouter

if TYPE_CHECKING:
    from prefixgate.gateway.proxy.prefix_entry import ProxyPrefix

__all__ = ["HeadersFor", "PrefixPlacement"]

HeadersFor = Callable[[Upstream], dict[str, str]]
_SHORT = aiohttp.ClientTimeout(total=5.0)


class PrefixPlacement:
    """Registers prefixes on, and releases them from, the upstreams of ``router``.

    Args:
        router: the upstream pool (its session, health, models and routing policy; the
            prefix's text is routed as a request's, ``UpstreamRouter.route``).
    """

    def __init__(self, router: UpstreamRouter):
        self._router = router

    def route(self, entry: ProxyPrefix) -> Route:
        """The routing of the prefix's own text under its cache salt (what a request starting
        with it is routed by)."""
        body = {"messages": entry.messages}
        return self._router.route(body, entry.cache_salt, self._router.resolve(entry.model))

    def _model(self, entry: ProxyPrefix) -> str:
        """The public model name of the prefix's ``model`` (an alias resolved)."""
        return self._router.resolve(entry.model) or entry.model

    async def place(self, entry: ProxyPrefix, headers_for: HeadersFor, first: bool) -> None:
        """Register ``entry`` on the upstream routing picks (others in turn when it fails);
        on an upstream without the prefix API the text simply stays here."""
        router = self._router
        route = self.route(entry)
        tried: list[Upstream] = []
        while True:
            up = router.pick(route, tried)
            if up is None:
                raise router.exhausted(tried, "no upstream could register the prefix")
            tried.append(up)
            headers = headers_for(up)
            if up.prefix_api is not False:
                done = await self._register_on(up, entry, headers)
                if done is None:
                    continue  # that upstream failed: the next one
                if done:
                    entry.headers = headers
                    return
            if first:  # kept here: count its tokens where the upstream can
                entry.prompt_tokens = await self._count(up, entry, headers)
            return

    async def _register_on(
        self, up: Upstream, entry: ProxyPrefix, headers: dict[str, str]
    ) -> bool | None:
        """POST the prefix to ``up``'s prefix API. True: registered (``entry`` updated);
        False: ``up`` has no prefix API; None: ``up`` failed (marked so).

        Raises:
            APIError: ``up``'s own 4xx answer (the request's fault or its limits).
        """
        assert self._router.session is not None
        body: dict[str, Any] = {
            "model": up.upstream_model(self._model(entry)),
            "messages": entry.messages,
            "ttl_seconds": max(1, math.ceil(entry.seconds_left())),
        }
        if entry.cache_salt is not None and up.cache_salt is not False:
            body["cache_salt"] = entry.cache_salt
        try:
            async with self._router.session.post(
                up.url + "/v1/prefixes", json=body, headers=headers, timeout=_SHORT, ssl=up.ssl
            ) as resp:
                data = await resp.read()
                status = resp.status
                answered = resp.headers
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self._router.mark_failed(up, f"POST /v1/prefixes: {type(exc).__name__}")
            return None
        error = _error(data)
        if status == 200:
            try:
                obj = json.loads(data)
                entry.upstream, entry.upstream_id = up.url, str(obj["id"])
                entry.prompt_tokens = int(obj.get("prompt_tokens", 0))
            except (ValueError, KeyError, TypeError):
                self._router.mark_failed(up, "POST /v1/prefixes: not a prefix object")
                return None
            up.prefix_api = True
            return True
        if status in (405, 501) or (status == 404 and error.get("code") != "model_not_found"):
            up.prefix_api = False
            return False
        if status >= 500:
            self._router.mark_failed(up, f"POST /v1/prefixes: HTTP {status}")
            return None
        if status in (401, 403):  # about the credential sent: never its body
            raise auth_error(status, up.url, own_credential=True)
        secrets = secrets_of(None, headers.get("Authorization"))
        raise upstream_error(status, data, answered, secrets)  # the request's fault or limits

    async def _count(self, up: Upstream, entry: ProxyPrefix, headers: dict[str, str]) -> int:
        """The prefix's tokens by ``up``'s ``POST /tokenize`` (vLLM's), 0 without it."""
        assert self._router.session is not None
        body = {
            "model": up.upstream_model(self._model(entry)),
            "messages": entry.messages,
            "add_generation_prompt": False,
        }
        try:
            async with self._router.session.post(
                up.url + "/tokenize", json=body, headers=headers, timeout=_SHORT, ssl=up.ssl
            ) as resp:
                if resp.status != 200:
                    return 0
                count = (await resp.json(content_type=None)).get("count")
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, AttributeError):
            return 0
        return count if isinstance(count, int) and not isinstance(count, bool) else 0

    async def release(self, entry: ProxyPrefix, headers_for: HeadersFor) -> None:
        """DELETE the prefix's pin on its upstream (best effort: a dead upstream took its
        pins with it, and an unreachable one releases it at the TTL)."""
        if entry.upstream is None or entry.upstream_id is None:
            return
        up = self._router.find(entry.upstream)
        if up is None or self._router.session is None:
            return
        try:
            async with self._router.session.delete(
                f"{up.url}/v1/prefixes/{entry.upstream_id}",
                headers=headers_for(up),
                timeout=_SHORT,
            ) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError):
            pass


def _error(data: bytes) -> dict[str, Any]:
    """The ``error`` object of an OpenAI error body, ``{}`` when it is none."""
    try:
        obj = json.loads(data)
    except ValueError:
        return {}
    err = obj.get("error") if isinstance(obj, dict) else None
    return err if isinstance(err, dict) else {}
