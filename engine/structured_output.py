"""Constrained decoding with xgrammar (the default structured-output backend of vLLM and SGLang).

Pieces, as in vLLM v1 (``vllm/v1/structured_output``):

- ``grammar_of(spec)``: ``StructuredOutputsParams`` → ``xgrammar.Grammar`` (the cheap
  conversion; it raises ``ValueError`` naming the field on an invalid or unsupported schema,
  regex or grammar, so bad input is refused before the request is queued).
- ``StructuredOutputManager``: one per engine; owns the ``TokenizerInfo`` (built from the HF
  ``tokenizers`` vocabulary, byte-fallback and byte-level BPE alike, sized to the model's logits),
  a ``GrammarCompiler`` and a thread pool. Each distinct spec is compiled once (an LRU cache of
  futures, cachetools) off the step loop: a request whose grammar is still compiling waits and
  the scheduler skips it without stalling the others.
- ``StructuredOutputRequest``: lives on the ``Request`` (``request.structured_output``); holds
  the ``GrammarMatcher``, which advances with every sampled token. The request keeps its output
  tokens across preemption, so the matcher (kept on the request) stays in step with them.

The logits pipeline's first step (``prefixgate.engine.logits_processors.GrammarMask``) asks
each constrained row of a batch for its token bitmask and applies it to that row only
(``apply_bitmask``); unconstrained rows are untouched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import cachetools
import torch
import xgrammar as xgr
from prefixgate.engine.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# JSON is generated without free whitespace (compact ", " / ": " separators): a model that
# never saw JSON would otherwise spend its tokens on spaces and newlines (vLLM's
# ``disable_any_whitespace``).
_JSON_OPTIONS: dict[str, Any] = {"any_whitespace": False, "strict_mode": True}


_GRAMMARS: cachetools.LRUCache[str, xgr.Grammar] = cachetools.LRUCache(512)
_GRAMMARS_LOCK = threading.Lock()


def grammar_of(spec: StructuredOutputsParams) -> xgr.Grammar:
    """Convert a constraint to an ``xgrammar.Grammar`` (no tokenizer needed). Conversions
    are cached by ``spec.key()`` (LRU): the gateway converts in a worker thread first, so the
    engine's check on the event loop is a cache hit.

    Raises:
        ValueError: an invalid JSON schema, a schema feature xgrammar does not support, an
            invalid regex, EBNF grammar or structural tag (or a JSON schema in it); the
            message starts with the field (``structured_outputs.json`` ...).
    """
    key = spec.key()
    with _GRAMMARS_LOCK:
        hit = _GRAMMARS.get(key)
    if hit is not None:
        return hit
    grammar = _convert(spec)
    with _GRAMMARS_LOCK:
        _GRAMMARS[key] = grammar
    return grammar


def _convert(spec: StructuredOutputsParams) -> xgr.Grammar:
    kind = spec.kind
    with native_warnings() as warnings:
        grammar = _convert_quietly(spec)
    warned = [w for w in warnings if not any(b in w for b in BENIGN_WARNINGS)]
    if warned:  # xgrammar said it drops part of the constraint: refused, never half-enforced
        raise ValueError(
            f"structured_outputs.{kind}: not enforced exactly by the grammar compiler "
            f"(xgrammar: {warned[0][:240]})"
        )
    return grammar


_STDERR_LOCK = threading.Lock()

# xgrammar warnings that say the constraint is enforced as written (every other warning it
# prints while building a grammar refuses the constraint): a regex escape of a character
# without special meaning (``re.escape``'s ``\ ``) matches that character, as in Python.
BENIGN_WARNINGS = ("The character itself will be matched",)


@contextlib.contextmanager
def native_warnings() -> Iterator[list[str]]:
    """Collect the warnings xgrammar's C++ code prints while the block runs.

    xgrammar reports a schema keyword or regex feature it drops (``pattern`` with
    ``minLength``, ``multipleOf`` on a number, a lookahead, ``oneOf`` with overlapping
    branches, ...) only as a line on the process's stderr (file descriptor 2), never to
    Python. The block runs with fd 2 redirected to a temporary file (one block at a time);
    afterwards xgrammar's ``Warning:`` lines are returned (their text) and anything else that
    was written meanwhile (another thread's logging) is written on to the real stderr.
    Without a usable fd 2 nothing is collected.

    Yields:
        The list the warning texts are appended to when the block ends.
    """
    found: list[str] = []
    with _STDERR_LOCK:
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError):
            yield found
            return
        with tempfile.TemporaryFile() as tmp:
            os.dup2(tmp.fileno(), 2)
            try:
                yield found
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                tmp.seek(0)
                other: list[bytes] = []
                for line in tmp.read().splitlines(keepends=True):
                    text = line.decode("utf-8", "replace")
                    if "/cpp/" in text and "Warning:" in text:
                        found.append(text.split("Warning:", 1)[1].strip())
                    else:
                        other.append(line)
                if other:
                    os.write(2, b"".join(other))


def _convert_quietly(spec: StructuredOutputsParams) -> xgr.Grammar:
    kind = spec.kind
    value: Any = getattr(spec, kind)  # the one constraint given (never None: spec.kind)
    try:
        if kind == "json":
            if isinstance(value, dict):
                check_schema(value)
                value = exact_one_of(value)
            return exact_json_strings(
                xgr.Grammar.from_json_schema(
                    value if isinstance(value, dict) else {}, **_JSON_OPTIONS
                )
            )
        if kind == "json_object":
            return xgr.Grammar.from_json_schema({"type": "object"}, **_JSON_OPTIONS)
        if kind == "regex":
            return xgr.Grammar.from_regex(value)
        if kind == "structural_tag":
            check_structural_tag_schemas(value)
            return exact_json_strings(xgr.Grammar.from_structural_tag(_tag_one_of(value)))
        if kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_string(c) for c in value))
        return xgr.Grammar.from_ebnf(value)
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors are RuntimeError
        raise ValueError(f"structured_outputs.{kind}: {reworded_error(kind, exc)}") from None


# xgrammar's C++ errors start with its log prefix, ``[03:16:06] /project/cpp/x.cc:94: ``
# (a time and a source path of the build machine); a path may also appear inside the text.
_LOG_PREFIX = re.compile(r"^\[[0-9:. ]*\]\s*")
_SOURCE_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.+-]+)+\.(?:cc|cpp|cxx|h|hpp|py):\d+:?\s*")
# a regex is lowered to EBNF before parsing: a position in that EBNF is not the client's
_EBNF_POSITION = re.compile(r"EBNF (?:parser|lexer) error at line \d+, column \d+:\s*")
_WHAT = {
    "regex": "invalid regex",
    "grammar": "invalid EBNF grammar",
    "choice": "invalid choice",
    "json": "invalid JSON schema",
    "json_object": "invalid JSON schema",
    "structural_tag": "invalid structural tag",
}


def reworded_error(kind: str, exc: BaseException) -> str:
    """The client's message for a failed grammar conversion of a ``kind`` constraint: what is
    wrong, in the client's terms, never the compiler's log prefix or source paths.

    ``Regex parsing error at position 4: The parenthesis is not closed.`` becomes ``invalid
    regex at position 4: The parenthesis is not closed.``; a regex's error found in its EBNF
    lowering loses the EBNF position (``invalid regex: Lower bound is larger than upper
    bound: 3 > 1``); a grammar keeps its line and column; a constraint too deep for the
    compiler's recursion says so. At most 300 characters.
    """
    if isinstance(exc, RecursionError):  # Python's words about its own stack, not the input's
        return f"{_WHAT.get(kind, 'invalid constraint')}: nested too deeply to compile"
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    msg = _SOURCE_PATH.sub("", _LOG_PREFIX.sub("", first)).strip()
    what = _WHAT.get(kind, "invalid constraint")
    if kind == "regex":
        msg = _EBNF_POSITION.sub("", msg)
        found = re.match(r"Regex parsing error (at position \d+):\s*(.*)", msg)
        msg = f"{what} {found.group(1)}: {found.group(2)}" if found else f"{what}: {msg}"
    else:
        found = re.match(r"EBNF (?:parser|lexer) error (at line \d+, column \d+):\s*(.*)", msg)
        if found:
            msg = f"{what} {found.group(1)}: {found.group(2)}"
        elif not re.match(r"(invalid|unsupported)\b", msg, re.IGNORECASE):
            msg = f"{what}: {msg}"
    return msg[:300]


# xgrammar (0.2.x, mlc-ai/xgrammar#800) lowers a string with minLength/maxLength to a bounded
# repetition of this class: it admits raw U+0000-U+001F (invalid JSON: strict parsers reject
# the answer, "Invalid control character") and no escape, so a bounded string can neither be
# valid JSON with a tab nor contain a quote. Each repetition becomes one JSON character: an
# unescaped code point outside the C0 range, a short escape, or a \uXXXX escape (a surrogate
# pair counts as two, so maxLength is never exceeded).
_BOUNDED_STRING_CHAR = r"(([^\"\\\r\n]))"
_EXACT_STRING_CHAR = (
    r'(([^\0-\x1f\"\\]) | ("\\" [\"\\/bfnrt]) | '
    r'("\\u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))'
)


def exact_json_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    """``grammar`` with every length-bounded JSON string rule made exact (see
    ``_BOUNDED_STRING_CHAR``): only valid JSON strings, escapes allowed, each escape one
    character of the bound. A grammar without such a rule is returned as is."""
    text = str(grammar)
    if _BOUNDED_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CHAR, _EXACT_STRING_CHAR))


def check_schema(schema: dict[str, Any]) -> None:
    """Validate a JSON schema against its metaschema (jsonschema), so a malformed schema is a
    clear error rather than a grammar that allows something else, and refuse keywords the
    grammar would not enforce (``UNSUPPORTED_SCHEMA_KEYWORDS``).

    Raises:
        ValueError: the schema is invalid or uses an unsupported feature (path named).
    """
    import jsonschema  # noqa: PLC0415 - only needed for JSON schemas

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.path)
        where = f" at {path}" if path else ""
        raise ValueError(f"invalid JSON schema{where}: {exc.message[:200]}") from None
    found = unsupported_schema_feature(schema)
    if found is not None:
        raise ValueError(f"unsupported JSON schema feature {found}")


def check_structural_tag_schemas(tag: Any, path: str = "") -> None:
    """``check_schema`` every JSON schema inside a structural tag (the ``json_schema`` of each
    ``{"type": "json_schema"}`` format, however deeply nested in tags, sequences, ...).

    Raises:
        ValueError: the first invalid or unsupported schema, with its path in the tag
            (``format.tags.0.content: ...``).
    """
    if isinstance(tag, dict):
        if tag.get("type") == "json_schema" and isinstance(tag.get("json_schema"), dict):
            try:
                check_schema(tag["json_schema"])
            except ValueError as exc:
                raise ValueError(f"{path or 'root'}: {exc}") from None
        for key, value in tag.items():
            check_structural_tag_schemas(value, f"{path}.{key}" if path else key)
    elif isinstance(tag, list):
        for i, value in enumerate(tag):
            check_structural_tag_schemas(value, f"{path}.{i}")


# JSON-schema keywords xgrammar 0.2 does not enforce (it would accept output that violates
# them): refused by name rather than silently ignored (vLLM refuses the same kind).
UNSUPPORTED_SCHEMA_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "dependentSchemas",
        "dependentRequired",
        "dependencies",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "patternProperties",
        "propertyNames",
        "unevaluatedProperties",
        "unevaluatedItems",
        "contentEncoding",
        "contentMediaType",
        "contentSchema",
    }
)


# String formats xgrammar 0.2 turns into a grammar (each checked to reject a malformed value,
# tests/engine/test_schema_keywords.py); any other ``format`` it ignores without a word.
ENFORCED_FORMATS = frozenset(
    {
        "date",
        "time",
        "date-time",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
        "uuid",
    }
)

_RANGE_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _keyword_combination(schema: dict[str, Any]) -> str | None:
    """A keyword (or combination) of this one schema object that xgrammar drops or does not
    enforce exactly, named, or ``None``."""
    length = [k for k in ("minLength", "maxLength") if k in schema]
    if length and "pattern" in schema:
        return f"pattern with {'/'.join(length)} (the length would be ignored)"
    fmt = schema.get("format")
    if fmt is not None:
        if fmt not in ENFORCED_FORMATS:
            return f"format {str(fmt)[:60]!r} (not enforced; enforced: {sorted(ENFORCED_FORMATS)})"
        if length:
            return f"format with {'/'.join(length)} (the length would be ignored)"
    if "multipleOf" in schema:
        step = schema["multipleOf"]
        if schema.get("type") != "integer":
            return "multipleOf on a non-integer type (only integer multiples are enforced)"
        if isinstance(step, bool) or not isinstance(step, int):
            return "multipleOf with a non-integer value on an integer"
        ranged = [k for k in _RANGE_KEYWORDS if k in schema]
        if ranged:
            return f"multipleOf with {'/'.join(ranged)} (the multiple would be ignored)"
    return None


def unsupported_schema_feature(schema: Any, path: str = "#") -> str | None:
    """The first keyword or keyword combination of ``schema`` (walked through its subschemas)
    that the grammar would not enforce, as ``"<path>: <keyword>"``, or ``None``: the keywords
    of ``UNSUPPORTED_SCHEMA_KEYWORDS``; ``allOf`` with more than one member; ``pattern`` or
    ``format`` with ``minLength`` / ``maxLength``; a ``format`` outside ``ENFORCED_FORMATS``;
    ``multipleOf`` other than an integer step on a ``type: integer`` without range keywords.
    (Whatever else xgrammar reports dropping is refused when the grammar is built,
    ``native_warnings``.)"""
    if not isinstance(schema, dict):
        return None
    for key in schema:
        if key in UNSUPPORTED_SCHEMA_KEYWORDS:
            return f"{path}: {key}"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return f"{path}: allOf with more than one schema"
    combination = _keyword_combination(schema)
    if combination is not None:
        return f"{path}: {combination}"
    subs: list[tuple[str, Any]] = []
    for key in ("properties", "$defs", "definitions"):
        value = schema.get(key)
        if isinstance(value, dict):
            subs += [(f"{path}/{key}/{name}", sub) for name, sub in value.items()]
    for key in ("items", "additionalProperties", "additionalItems"):
        if isinstance(schema.get(key), dict):
            subs.append((f"{path}/{key}", schema[key]))
    for key in ("prefixItems", "anyOf", "oneOf", "allOf", "items"):
        value = schema.get(key)
        if isinstance(value, list):
            subs += [(f"{path}/{key}/{i}", sub) for i, sub in enumerate(value)]
    for sub_path, sub in subs:
        found = unsupported_schema_feature(sub, sub_path)
        if found is not None:
            return found
    return None


def exact_one_of(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with every ``oneOf`` whose branches are told apart by one property written
    as ``anyOf`` (a copy; ``schema`` is not changed).

    xgrammar writes a ``oneOf`` as ``anyOf`` and warns (refused, ``native_warnings``) unless
    it proves the branches disjoint, which it does not through ``$ref``. A pydantic
    discriminated union (``Cat | Dog`` on ``kind``) is the common case: each branch an object
    requiring the same property with a ``const`` / ``enum`` of values no other branch has, so
    at most one branch matches any instance and ``anyOf`` means exactly ``oneOf``.
    """
    return _rewrite_one_of(schema, schema)


def _resolve(node: Any, root: dict[str, Any]) -> Any:
    """Follow a local ``$ref`` (``#/...``) once; anything else is returned as it is."""
    ref = node.get("$ref") if isinstance(node, dict) else None
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return node
    target: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            return node
        target = target[part]
    return target


def _tag_values(branch: Any, prop: str) -> set[str] | None:
    """The JSON texts ``prop`` may take in an object branch that requires it (``const`` or
    ``enum``), or ``None`` when the branch does not pin it. The branch must be
    ``type: object``: ``required`` says nothing about a string, which would match every
    branch."""
    if not isinstance(branch, dict) or branch.get("type") != "object":
        return None
    if prop not in (branch.get("required") or []):
        return None
    spec = (branch.get("properties") or {}).get(prop)
    if not isinstance(spec, dict):
        return None
    if "const" in spec:
        return {json.dumps(spec["const"], sort_keys=True)}
    if isinstance(spec.get("enum"), list):
        return {json.dumps(v, sort_keys=True) for v in spec["enum"]}
    return None


def _disjoint(branches: list[Any], root: dict[str, Any]) -> bool:
    resolved = [_resolve(b, root) for b in branches]
    first = resolved[0]
    candidates = list((first.get("properties") or {}) if isinstance(first, dict) else ())
    for prop in candidates:
        seen: set[str] = set()
        for b in resolved:
            values = _tag_values(b, prop)
            if values is None or values & seen:
                break
            seen |= values
        else:
            return True
    return False


def _rewrite_one_of(node: Any, root: dict[str, Any]) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in ("properties", "$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {k: _rewrite_one_of(v, root) for k, v in out[key].items()}
    for key in ("items", "additionalProperties", "additionalItems"):
        if isinstance(out.get(key), dict):
            out[key] = _rewrite_one_of(out[key], root)
    for key in ("prefixItems", "anyOf", "oneOf", "allOf", "items"):
        if isinstance(out.get(key), list):
            out[key] = [_rewrite_one_of(v, root) for v in out[key]]
    one_of = out.get("oneOf")
    if isinstance(one_of, list) and len(one_of) > 1 and "anyOf" not in out:
        if _disjoint(one_of, root):
            out["anyOf"] = out.pop("oneOf")
            out.pop("discriminator", None)
    return out


def _tag_one_of(tag: Any) -> Any:
    """``exact_one_of`` applied to every JSON schema inside a structural tag (a copy)."""
    if isinstance(tag, dict):
        out = {k: _tag_one_of(v) for k, v in tag.items()}
        if tag.get("type") == "json_schema" and isinstance(tag.get("json_schema"), dict):
            out["json_schema"] = exact_one_of(tag["json_schema"])
        return out
    if isinstance(tag, list):
        return [_tag_one_of(v) for v in tag]
    return tag


def _ebnf_string(text: str) -> str:
    """An EBNF string literal matching ``text`` exactly."""
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of a ``prefixgate.engine.tokenizer.Tokenizer`` (HF ``tokenizers``).

    Args:
        tokenizer: the engine tokenizer (its ``_tok`` is a ``tokenizers.Tokenizer``).
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary when the
            embedding is padded; the extra ids are never allowed).
        stop_token_ids: the ids that end generation (EOS); the grammar allows them only where
            the constrained text is complete.

    The vocabulary type (byte fallback ``<0x..>`` as Llama 2, or byte-level BPE as GPT-2 /
    Qwen / SmolLM2) and ``add_prefix_space`` come from the ``tokenizer.json`` metadata, checked
    against the vocabulary itself, as ``xgrammar.TokenizerInfo.from_huggingface`` does.
    """
    hf = tokenizer._tok
    vocab = hf.get_vocab(with_added_tokens=True)
    size = max(vocab_size, max(vocab.values()) + 1)
    encoded: list[str] = [""] * size
    for token, idx in vocab.items():
        encoded[idx] = token
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(hf.to_str())
    from_vocab = xgr.TokenizerInfo._detect_vocab_type_from_vocab(vocab)
    if from_vocab is not None and from_vocab != metadata["vocab_type"]:
        metadata["vocab_type"] = from_vocab
    return xgr.TokenizerInfo(
        encoded[:vocab_size] if vocab_size < size else encoded,
        vocab_type=metadata["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=sorted(stop_token_ids) or None,
        add_prefix_space=metadata["add_prefix_space"],
    )


class StructuredOutputRequest:
    """A request's grammar: the compiled grammar (a future) and its matcher.

    Attributes:
        spec: the request's constraint.
        future: resolves to the ``xgrammar.CompiledGrammar``.
        matcher: the ``GrammarMatcher`` once the grammar is ready (``None`` before).
        rejected: a sampled token the grammar did not accept (the request must fail).
        stop_ids_are_text: set by the logits pipeline for the step just sampled: the grammar's
            only tokens were the request's stop ids where it cannot end, so a sampled stop id
            is the grammar's text, not an end (``prefixgate.engine.logits_processors``).
    """

    __slots__ = ("spec", "future", "matcher", "rejected", "stop_ids_are_text", "_stop_ids")

    def __init__(
        self, spec: StructuredOutputsParams, future: Future, stop_token_ids: list[int]
    ) -> None:
        self.spec = spec
        self.future = future
        self.matcher: xgr.GrammarMatcher | None = None
        self.rejected: int | None = None
        self.stop_ids_are_text = False
        self._stop_ids = stop_token_ids

    @property
    def ready(self) -> bool:
        """True once the grammar compiled (creates the matcher); False while compiling or
        after a failed compilation (see ``error``)."""
        if self.matcher is not None:
            return True
        if not self.future.done() or self.future.exception() is not None:
            return False
        self.matcher = xgr.GrammarMatcher(
            self.future.result(), override_stop_tokens=self._stop_ids or None
        )
        return True

    @property
    def error(self) -> BaseException | None:
        """The compilation error, if compiling failed."""
        if self.future.done():
            return self.future.exception()
        return None

    @property
    def terminated(self) -> bool:
        """True when the matcher accepted a stop token (the constrained text is complete)."""
        return self.matcher is not None and self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (``[B, ceil(V/32)]`` int32)."""
        assert self.matcher is not None, "grammar not compiled yet"
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> None:
        """Advance the matcher by one sampled token (records a rejected one)."""
        if self.matcher is None or self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(token_id):
            self.rejected = token_id


class StructuredOutputManager:
    """Compiles constraints for one engine: once per distinct spec, off the step loop.

    Args:
        tokenizer: the engine tokenizer.
        vocab_size: the model's logits width.
        stop_token_ids: the model's EOS ids.
        cache_size: compiled grammars kept (LRU).
        max_workers: compiler threads.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        cache_size: int = 256,
        max_workers: int = 2,
    ) -> None:
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._tokenizer = tokenizer
        self._compiler: xgr.GrammarCompiler | None = None
        self._init_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cache: cachetools.LRUCache[str, Future] = cachetools.LRUCache(cache_size)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="prefixgate-grammar")
        self.num_compiled = 0  # compilations started (cache misses)
        self._bitmask_buf: torch.Tensor | None = None

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._init_lock:
            if self._compiler is None:
                info = tokenizer_info(self._tokenizer, self.vocab_size, self.stop_token_ids)
                # the compiler's own cache is off: ours (keyed by spec) is the one that counts
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def validate(self, spec: StructuredOutputsParams) -> None:
        """Raise ``ValueError`` naming the field when ``spec`` cannot compile (cheap: a spec
        already in the cache was valid)."""
        with self._lock:
            if spec.key() in self._cache:
                return
        grammar_of(spec)

    def request(self, spec: StructuredOutputsParams) -> StructuredOutputRequest:
        """The grammar state for a new request; starts the compilation unless it is cached."""
        key = spec.key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is None or (fut.done() and fut.exception() is not None):
                fut = self._pool.submit(self._compile, spec)
                self._cache[key] = fut
                self.num_compiled += 1
        return StructuredOutputRequest(spec, fut, self.stop_token_ids)

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        return self._get_compiler().compile_grammar(grammar_of(spec))

    def apply_bitmask(
        self, logits: torch.Tensor, rows: list[int], grammars: list[StructuredOutputRequest]
    ) -> None:
        """Mask, in place, every token the grammar forbids in ``logits[rows[i]]``.

        Args:
            logits: ``[B, V]`` float32 logits of the batch.
            rows: indices of the constrained rows.
            grammars: their grammar states (ready), same order.
        """
        if not rows:
            return
        width = logits.shape[1]
        bitmask = self._bitmask(logits.shape[0], width)
        for row, g in zip(rows, grammars, strict=True):
            g.fill_bitmask(bitmask, row)
        if logits.device != bitmask.device:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width, indices=rows)

    def _bitmask(self, batch: int, width: int) -> torch.Tensor:
        """A reused ``[batch, ceil(width / 32)]`` int32 host bitmask (rows that are not
        constrained are never read: ``indices`` names the constrained ones)."""
        shape = xgr.get_bitmask_shape(batch, width)
        buf = self._bitmask_buf
        if buf is None or buf.shape[0] < shape[0] or buf.shape[1] != shape[1]:
            buf = self._bitmask_buf = xgr.allocate_token_bitmask(max(batch, 64), width)
        return buf[:batch]

    def shutdown(self) -> None:
        """Stop the compiler threads (pending compilations are cancelled)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
