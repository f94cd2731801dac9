"""The proxy's config file (``prefixgate serve --config FILE``): a model list, each model
with its deployments, aliases and fallbacks, and per-deployment credentials and TLS.

TOML (``.toml``, read by the standard library's ``tomllib``) or YAML (``.yaml`` / ``.yml``,
read by PyYAML when installed). The shape, in TOML::

    [[models]]
    name = "chat"                      # the public model name clients send
    aliases = ["gpt-4o-mini"]          # other names it answers to
    fallbacks = ["small"]              # models tried, in order, when every deployment fails

    [[models.deployments]]
    url = "https://a.internal:8000/v1" # an OpenAI-compatible server
    model = "meta-llama/Llama-3.1-8B-Instruct"  # its own id of the model (default: name)
    dialect = "openai"                 # or "anthropic" (the Messages API, proxy.anthropic)
    api_key_env = "A_KEY"              # Bearer credential from an environment variable...
    # api_key_file = "/run/secrets/a"  # ...or from a file (one of the two at most)
    weight = 2                         # share of the load (> 0, default 1)
    max_in_flight = 64                 # most requests at once (0: no limit)
    tls = { ca_bundle = "ca.pem", client_cert = "c.pem", client_key = "c.key" }
    # tls = { verify = false }         # verification off: only this explicit flag

Relative paths are read from the config file's folder. The same URL may serve several
models (one upstream then, with the same credential and TLS in each). Every error is one
line naming the file and the field (``ValueError``), at start-up.
"""

from __future__ import annotations

import os
import ssl
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixgate.gateway.proxy.model_list import ModelEntry, ModelList
from prefixgate.gateway.proxy.upstream import Upstream, split_credentials

DIALECTS = ("openai", "anthropic")  # wire dialects of deployments (proxy.anthropic)
_MODEL_KEYS = frozenset(("name", "aliases", "fallbacks", "deployments"))
_DEPLOYMENT_KEYS = frozenset(
    ("url", "model", "dialect", "api_key_env", "api_key_file", "weight", "max_in_flight", "tls")
)
_TLS_KEYS = frozenset(("ca_bundle", "client_cert", "client_key", "verify"))


@dataclass(frozen=True, slots=True)
class Deployment:
    """One deployment of a model: its ``url``, its own ``model`` id, the ``Authorization``
    value (``auth``, None without), ``weight``, ``max_in_flight`` (0: none) and ``tls``
    (True: default verification; an ``ssl.SSLContext``; False: verification off)."""

    url: str
    model: str
    auth: str | None = None
    weight: float = 1.0
    max_in_flight: int = 0
    tls: ssl.SSLContext | bool = True
    tls_spec: tuple[tuple[str, Any], ...] = ()  # the tls table as written (to compare)
    dialect: str = "openai"


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """A read config file: the model list and each model's deployments, in order."""

    models: ModelList
    deployments: Mapping[str, tuple[Deployment, ...]] = field(default_factory=dict)
    source: str = ""

    def upstreams(self) -> list[Upstream]:
        """New ``Upstream`` objects, one per URL (a URL in several models serves each).

        Raises:
            ValueError: one URL given different credentials, TLS, weight or max_in_flight.
        """
        by_url: dict[str, Upstream] = {}
        seen: dict[str, Deployment] = {}
        for name, deps in self.deployments.items():
            for d in deps:
                url = split_credentials(d.url)[0]
                up = by_url.get(url)
                if up is None:
                    up = by_url[url] = Upstream(
                        d.url, d.auth, d.weight, d.max_in_flight, d.tls, {name: d.model}, d.dialect
                    )
                    seen[url] = d
                    continue
                first = seen[url]
                same = (first.auth, first.weight, first.max_in_flight, first.dialect) == (
                    d.auth,
                    d.weight,
                    d.max_in_flight,
                    d.dialect,
                ) and first.tls_spec == d.tls_spec
                if not same:
                    raise ValueError(
                        f"config {self.source}: {url} is given different credentials, TLS, "
                        "weight or max_in_flight in two models"
                    )
                up.names[name] = d.model
                up.models = frozenset(up.names)
        return list(by_url.values())


def load_config(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> ProxyConfig:
    """Read and check the config file at ``path`` (see the module docstring); credentials
    from ``env`` (default ``os.environ``) and files.

    Raises:
        ValueError: one line naming the file and the field: unreadable or malformed file,
            unknown or mistyped field, missing credential, unreadable TLS file, a dialect
            not served, a name given twice, a fallback to an unknown model.
    """
    p = Path(path)
    env = os.environ if env is None else env
    where = str(p)
    try:
        text = p.read_bytes()
    except OSError as exc:
        raise ValueError(f"config {where}: cannot read it ({exc.strerror or exc})") from None
    data = _parse(where, p.suffix.lower(), text)
    ctx = _Reader(where, p.parent, env)
    models = data.get("models")
    extra = set(data) - {"models"}
    if extra:
        raise ValueError(f"config {where}: unknown top-level field {sorted(extra)[0]!r}")
    if not isinstance(models, list) or not models:
        raise ValueError(f"config {where}: models must be a non-empty list of models")
    entries: list[ModelEntry] = []
    deployments: dict[str, tuple[Deployment, ...]] = {}
    for i, m in enumerate(models):
        at = f"models[{i}]"
        m = ctx.table(m, at, _MODEL_KEYS)
        name = ctx.string(m.get("name"), at + ".name")
        aliases = ctx.strings(m.get("aliases", []), at + ".aliases")
        fallbacks = ctx.strings(m.get("fallbacks", []), at + ".fallbacks")
        deps = m.get("deployments")
        if not isinstance(deps, list) or not deps:
            raise ValueError(f"config {where}: {at}.deployments must be a non-empty list")
        if name in deployments:
            raise ValueError(f"config {where}: {at}.name {name!r} is given twice")
        deployments[name] = tuple(
            ctx.deployment(d, f"{at}.deployments[{j}]", name) for j, d in enumerate(deps)
        )
        entries.append(ModelEntry(name, tuple(aliases), tuple(fallbacks)))
    try:
        model_list = ModelList(entries)
    except ValueError as exc:
        raise ValueError(f"config {where}: {exc}") from None
    return ProxyConfig(model_list, deployments, where)


def _parse(where: str, suffix: str, text: bytes) -> dict[str, Any]:
    if suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ValueError(
                f"config {where}: YAML needs PyYAML (pip install pyyaml), or write it as TOML"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"config {where}: not YAML: {str(exc).splitlines()[0]}") from None
    elif suffix == ".toml":
        try:
            data = tomllib.loads(text.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"config {where}: not TOML: {exc}") from None
    else:
        raise ValueError(f"config {where}: the file must end in .toml, .yaml or .yml")
    if not isinstance(data, dict):
        raise ValueError(f"config {where}: the file must hold a table (mapping)")
    return data


@dataclass(slots=True)
class _Reader:
    where: str
    folder: Path
    env: Mapping[str, str]

    def fail(self, at: str, message: str) -> ValueError:
        return ValueError(f"config {self.where}: {at}: {message}")

    def table(self, value: Any, at: str, keys: frozenset[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(at, "must be a table (mapping)")
        unknown = sorted(set(value) - keys)
        if unknown:
            raise self.fail(at, f"unknown field {unknown[0]!r} (known: {', '.join(sorted(keys))})")
        return value

    def string(self, value: Any, at: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(at, "must be a non-empty string")
        return value

    def strings(self, value: Any, at: str) -> list[str]:
        if not isinstance(value, list):
            raise self.fail(at, "must be a list of strings")
        return [self.string(v, f"{at}[{i}]") for i, v in enumerate(value)]

    def path(self, value: Any, at: str) -> str:
        p = Path(os.path.expanduser(self.string(value, at)))
        p = p if p.is_absolute() else self.folder / p
        if not p.is_file():
            raise self.fail(at, f"no such file {str(p)!r}")
        return str(p)

    def deployment(self, value: Any, at: str, name: str) -> Deployment:
        d = self.table(value, at, _DEPLOYMENT_KEYS)
        url = self.string(d.get("url"), at + ".url")
        try:
            split_credentials(url)
        except ValueError as exc:
            raise self.fail(at + ".url", str(exc)) from None
        dialect = d.get("dialect", "openai")
        if dialect not in DIALECTS:
            raise self.fail(
                at + ".dialect",
                f"{dialect!r} is not served (deployments speak {', '.join(DIALECTS)})",
            )
        weight = d.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
            raise self.fail(at + ".weight", "must be a number > 0")
        cap = d.get("max_in_flight", 0)
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise self.fail(at + ".max_in_flight", "must be an integer >= 0")
        return Deployment(
            url=url,
            model=self.string(d.get("model", name), at + ".model"),
            auth=self.credential(d, at),
            weight=float(weight),
            max_in_flight=cap,
            tls=self.tls(d.get("tls"), at + ".tls"),
            tls_spec=tuple(sorted((d.get("tls") or {}).items())),
            dialect=dialect,
        )

    def credential(self, d: dict[str, Any], at: str) -> str | None:
        if "api_key_env" in d and "api_key_file" in d:
            raise self.fail(at, "give api_key_env or api_key_file, not both")
        if "api_key_env" in d:
            var = self.string(d["api_key_env"], at + ".api_key_env")
            key = self.env.get(var)
            if not key:
                raise self.fail(at + ".api_key_env", f"the environment variable {var} is not set")
        elif "api_key_file" in d:
            path = self.path(d["api_key_file"], at + ".api_key_file")
            try:
                key = Path(path).read_text().strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise self.fail(at + ".api_key_file", f"cannot read it ({exc})") from None
            if not key:
                raise self.fail(at + ".api_key_file", "the file is empty")
        else:
            return None
        if any(c in key for c in "\r\n\x00"):
            raise self.fail(at, "the credential holds a line break or NUL")
        return "Bearer " + key

    def tls(self, value: Any, at: str) -> ssl.SSLContext | bool:
        if value is None:
            return True
        t = self.table(value, at, _TLS_KEYS)
        verify = t.get("verify", True)
        if not isinstance(verify, bool):
            raise self.fail(at + ".verify", "must be true or false")
        if not verify:
            if "ca_bundle" in t:
                raise self.fail(at, "verify = false and a ca_bundle contradict each other")
            if "client_cert" not in t:
                return False
        if "client_key" in t and "client_cert" not in t:
            raise self.fail(at + ".client_key", "needs client_cert")
        ca = self.path(t["ca_bundle"], at + ".ca_bundle") if "ca_bundle" in t else None
        try:
            ctx = ssl.create_default_context(cafile=ca)
        except (ssl.SSLError, OSError) as exc:
            raise self.fail(at + ".ca_bundle", f"not a CA bundle ({exc})") from None
        if not verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if "client_cert" in t:
            cert = self.path(t["client_cert"], at + ".client_cert")
            key = self.path(t["client_key"], at + ".client_key") if "client_key" in t else None
            try:
                ctx.load_cert_chain(cert, key)
            except (ssl.SSLError, OSError) as exc:
                raise self.fail(at + ".client_cert", f"not a certificate and key ({exc})") from None
        return ctx
