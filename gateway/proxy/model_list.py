"""The model list of a config file (``--config``): each public model name, its aliases and
the models it falls back to (``ModelList``). Which deployment serves which model is on the
``Upstream`` objects (``Upstream.names``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One public model: ``name``, other names it answers to (``aliases``), the models a
    request falls back to when every deployment of it fails (``fallbacks``, in order)."""

    name: str
    aliases: tuple[str, ...] = ()
    fallbacks: tuple[str, ...] = ()


@dataclass(slots=True)
class ModelList:
    """The public models of a config file, by name and alias.

    Raises:
        ValueError: a name or alias given twice, a fallback to an unknown model or to itself.
    """

    entries: Sequence[ModelEntry]
    _by_name: dict[str, ModelEntry] = field(init=False, default_factory=dict)
    _alias: dict[str, str] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        for e in self.entries:
            for name in (e.name, *e.aliases):
                if name in self._by_name or name in self._alias:
                    raise ValueError(f"model name {name!r} is given twice (names and aliases)")
                if name == e.name:
                    self._by_name[name] = e
                else:
                    self._alias[name] = e.name
        for e in self.entries:
            for fb in e.fallbacks:
                target = self._alias.get(fb, fb)
                if target not in self._by_name:
                    raise ValueError(f"model {e.name!r}: fallback {fb!r} is not a model")
                if target == e.name:
                    raise ValueError(f"model {e.name!r}: falls back to itself")

    def resolve(self, name: str) -> str | None:
        """The model name of ``name`` (itself, or the model it is an alias of); None when
        neither."""
        if name in self._by_name:
            return name
        return self._alias.get(name)

    def fallbacks(self, name: str) -> list[str]:
        """The model names ``name`` falls back to, in order (aliases resolved)."""
        e = self._by_name.get(name)
        return [self._alias.get(f, f) for f in e.fallbacks] if e is not None else []

    def names(self) -> list[str]:
        """Every public model name, then every alias, in the config's order."""
        return [e.name for e in self.entries] + [a for e in self.entries for a in e.aliases]

    def aliases(self) -> Mapping[str, str]:
        """Alias -> model name."""
        return dict(self._alias)
