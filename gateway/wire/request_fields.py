"""Every request field of OpenAI's chat and completions APIs: implemented, or refused by name.

The lists name each field of openai-python's ``CompletionCreateParams`` (chat and legacy
completions; a test checks them against the installed package) and say what the gateway does
with it. A field in ``REFUSED`` with a value other than its no-op value is a 400 naming it; a
field in no list is a 400 "Unrecognized request argument supplied: NAME", as OpenAI answers.

Structured output requests come in four spellings, mapped onto one engine constraint
(``StructuredOutputsParams``): OpenAI's ``response_format`` (``text`` / ``json_object`` /
``json_schema`` with ``strict``), vLLM's ``structured_outputs`` object, and vLLM's older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``. At most one may be
given (and none with a ``tool_choice`` that constrains the output).
"""

from __future__ import annotations

import json
import re
from typing import Any

from prefixgate.engine.sampling_params import StructuredOutputsParams
from prefixgate.gateway.http.errors import APIError, bad_request

# OpenAI chat fields the gateway implements.
CHAT_SUPPORTED = {
    "messages": "rendered with the model's chat template (tool calls and tool results too)",
    "model": "must name the served model",
    "frequency_penalty": "OpenAI's formula, output tokens",
    "presence_penalty": "OpenAI's formula, output tokens",
    "logit_bias": "token id -> bias in [-100, 100], ids checked against the vocabulary",
    "logprobs": "logprob of each token (natural log), with its bytes",
    "top_logprobs": "0-20 alternatives per token",
    "max_completion_tokens": "output limit",
    "max_tokens": "output limit (deprecated name)",
    "n": "choices (1-16), one engine request each",
    "parallel_tool_calls": "false: at most one call (tool_choice 'required')",
    "response_format": "text, json_object, json_schema (strict or not: always enforced)",
    "seed": "per-choice seed (seed + index)",
    "stop": "up to 4 stop strings",
    "stream": "server-sent events",
    "stream_options": "include_usage; vLLM's continuous_usage_stats (usage on every chunk)",
    "temperature": "0-2 (0 = greedy)",
    "tool_choice": "none, auto (--tool-call-parser), required, a named function",
    "tools": "function tools; parameters must be a JSON schema",
    "top_p": "nucleus sampling",
    "user": "accepted: an end-user identifier (logged, does not change generation)",
    "safety_identifier": "accepted: an end-user identifier (does not change generation)",
    "prompt_cache_key": "accepted: every prompt is prefix-cached already (use cache_salt to "
    "partition)",
    "prompt_cache_options": "mode implicit (a pinned breakpoint at the end of the messages) "
    "or explicit (the parts' prompt_cache_breakpoint only); ttl 30m",
    "prompt_cache_retention": "in_memory (the prefix cache, as every prompt) or 24h (the "
    "messages pinned for 24 h, charged to the key's pin share)",
    "store": "only false (nothing is stored)",
    "service_tier": "only 'auto' or 'default'",
    "modalities": "only ['text']",
}

# OpenAI completions fields the gateway implements.
COMPLETIONS_SUPPORTED = {
    "model": "must name the served model",
    "prompt": "a string, token ids, or a batch of either",
    "best_of": "only null or equal to n (no server-side ranking)",
    "frequency_penalty": "OpenAI's formula",
    "presence_penalty": "OpenAI's formula",
    "logit_bias": "token id -> bias in [-100, 100]",
    "logprobs": "0-20 top alternatives (tokens never merged in top_logprobs)",
    "max_tokens": "output limit (default 16)",
    "n": "choices per prompt",
    "seed": "per-choice seed",
    "stop": "up to 4 stop strings",
    "stream": "server-sent events",
    "stream_options": "include_usage; vLLM's continuous_usage_stats (usage on every chunk)",
    "temperature": "0-2",
    "top_p": "nucleus sampling",
    "user": "accepted: an end-user identifier (does not change generation)",
}

# OpenAI fields refused unless they hold their no-op value (the second item).
REFUSED: dict[str, tuple[str, Any]] = {
    "audio": ("audio output is not supported", None),
    "function_call": ("the deprecated function_call is not supported; use tool_choice", None),
    "functions": ("the deprecated functions is not supported; use tools", None),
    "metadata": ("metadata is not stored (store is not supported)", None),
    "moderation": ("moderation is not supported", None),
    "prediction": ("predicted outputs are not supported", None),
    "reasoning_effort": ("reasoning_effort is not supported (not a reasoning model)", None),
    "verbosity": ("verbosity is not supported", None),
    "web_search_options": ("web search is not supported", None),
    "echo": ("echo is not supported", False),
    "suffix": ("suffix is not supported", None),
}

# Server-specific fields (vLLM's names), sent by OpenAI clients through ``extra_body``.
EXTRAS = {
    "top_k": "keep the k most likely tokens (-1: all)",
    "min_p": "drop tokens below min_p x the top probability",
    "repetition_penalty": "CTRL / Hugging Face repetition penalty",
    "ignore_eos": "keep generating past EOS",
    "min_tokens": "EOS and stop token ids masked until this many tokens",
    "stop_token_ids": "token ids that end generation (checked against the vocabulary)",
    "skip_special_tokens": "leave special tokens out of the text (default true; kept under "
    "tool_choice auto, where the tool-call parser reads them)",
    "include_stop_str_in_output": "keep the stop string (or stop token's text) that ended the "
    "answer at its end",
    "bad_words": "words never generated (vLLM's: as written and after a space)",
    "truncate_prompt_tokens": "keep the prompt's last k tokens (-1: max_model_len; at most "
    "max_model_len)",
    "cache_salt": "prefix-cache partition inside the API key's",
    "structured_outputs": "vLLM: {json | json_object | regex | choice | grammar | structural_tag}",
    "guided_json": "vLLM (older): a JSON schema",
    "guided_regex": "vLLM (older): a regular expression",
    "guided_choice": "vLLM (older): a list of strings",
    "guided_grammar": "vLLM (older): an EBNF grammar",
}
CHAT_EXTRAS = {
    "prefix_id": "prefixgate: prepend a pinned prefix's messages",
    "chat_template_kwargs": "vLLM: more variables for the chat template (an object; keys the "
    "request sets itself and special-token strings refused)",
    "add_generation_prompt": "vLLM: end the prompt with the assistant turn's opening (default "
    "true)",
    "continue_final_message": "vLLM: end the prompt inside the last message, to continue it "
    "(needs add_generation_prompt false)",
}

_SCHEMA_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def known_fields() -> frozenset[str]:
    """Every top-level request field of chat and completions this module names (implemented,
    refused, vLLM's and prefixgate's extras)."""
    return frozenset(
        (*CHAT_SUPPORTED, *COMPLETIONS_SUPPORTED, *REFUSED, *EXTRAS, *CHAT_EXTRAS, "priority")
    )


def unrecognized(name: str) -> APIError:
    """OpenAI's answer to an unknown field."""
    return bad_request(f"Unrecognized request argument supplied: {name[:80]}", param=name[:80])


def check_refused(body: dict[str, Any], n: int = 1) -> None:
    """400 naming the first refused field that holds more than its no-op value.

    Raises:
        APIError: 400 ``unsupported_parameter``.
    """
    for name, (why, noop) in REFUSED.items():
        value = body.get(name)
        if value is not None and value != noop and not (name == "suffix" and value == ""):
            raise APIError(400, f"{name}: {why}", param=name, code="unsupported_parameter")
    checks = {
        "store": lambda v: v in (None, False),
        "service_tier": lambda v: v in (None, "auto", "default"),
        "modalities": lambda v: v is None or v == ["text"],
        "best_of": lambda v: v is None or v == n,
    }
    for name, ok in checks.items():
        if name in body and not ok(body[name]):
            raise APIError(
                400,
                f"{name}: {json.dumps(body[name])[:80]} is not supported "  # as sent: true
                f"({CHAT_SUPPORTED.get(name) or COMPLETIONS_SUPPORTED.get(name)})",
                param=name,
                code="unsupported_parameter",
            )


def structured_from(req: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the field it came from (for error messages).

    Raises:
        APIError: 400 naming the field: more than one source, a malformed
            ``response_format`` / ``structured_outputs`` / ``guided_*``.
    """
    sources: list[tuple[str, StructuredOutputsParams]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None:
        spec = _from_response_format(rf)
        if spec is not None:
            sources.append(("response_format", spec))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("structured_outputs: must be an object", param="structured_outputs")
        sources.append(("structured_outputs", _spec("structured_outputs", **so)))
    for name, kind in _GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            sources.append((name, _spec(name, **{kind: value})))
    if len(sources) > 1:
        names = ", ".join(n for n, _ in sources)
        raise bad_request(
            f"{sources[1][0]}: only one output constraint per request (got {names})",
            param=sources[1][0],
        )
    if not sources:
        return None, None
    return sources[0][1], sources[0][0]


def _spec(field: str, **kwargs: Any) -> StructuredOutputsParams:
    allowed = {"json", "json_object", "regex", "choice", "grammar", "structural_tag"}
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise bad_request(
            f"{field}: unknown key {unknown[0][:80]!r} (one of {sorted(allowed)})", param=field
        )
    try:
        return StructuredOutputsParams(**kwargs)
    except (ValueError, TypeError) as exc:
        msg = str(exc).replace("structured_outputs", field, 1)
        raise bad_request(
            msg if msg.startswith(field) else f"{field}: {msg}", param=field
        ) from None


# The keys OpenAI defines in each response_format (any other is refused, never ignored).
_RESPONSE_FORMAT_KEYS = {
    "text": {"type"},
    "json_object": {"type"},
    "json_schema": {"type", "json_schema"},
}
_JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


def _refuse_unknown_keys(obj: dict[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(str(k) for k in obj if k not in known)
    if unknown:
        name = f"{where}.{unknown[0][:80]}"
        raise bad_request(f"Unrecognized request argument supplied: {name}", param=name)


def _from_response_format(rf: Any) -> StructuredOutputsParams | None:
    if not isinstance(rf, dict):
        raise bad_request("response_format: must be an object", param="response_format")
    kind = rf.get("type")
    if isinstance(kind, str) and kind in _RESPONSE_FORMAT_KEYS:
        _refuse_unknown_keys(rf, _RESPONSE_FORMAT_KEYS[kind], "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad_request(
                "response_format.json_schema: an object {name, schema, strict} is required",
                param="response_format.json_schema",
            )
        _refuse_unknown_keys(js, _JSON_SCHEMA_KEYS, "response_format.json_schema")
        name = js.get("name")
        if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
            raise bad_request(
                "response_format.json_schema.name: must match ^[a-zA-Z0-9_-]{1,64}$",
                param="response_format.json_schema.name",
            )
        if "strict" in js and js["strict"] is not None and not isinstance(js["strict"], bool):
            raise bad_request(
                "response_format.json_schema.strict: must be a boolean",
                param="response_format.json_schema.strict",
            )
        schema = js.get("schema")
        if schema is None:
            return StructuredOutputsParams(json_object=True)
        if not isinstance(schema, dict):
            raise bad_request(
                "response_format.json_schema.schema: must be a JSON schema (an object)",
                param="response_format.json_schema.schema",
            )
        return StructuredOutputsParams(json=schema)
    raise bad_request(
        f"response_format.type: must be 'text', 'json_object' or 'json_schema', got "
        f"{str(kind)[:80]!r}",
        param="response_format.type",
    )


def check_constraint(spec: StructuredOutputsParams, field: str) -> None:
    """Convert the constraint to a grammar once (cheap, cached by the caller's LRU) so an
    invalid or unsupported schema is a 400 naming the request's field.

    Raises:
        APIError: 400 naming ``field``.
    """
    from prefixgate.engine.structured_output import grammar_of  # noqa: PLC0415 - xgrammar

    try:
        grammar_of(spec)
    except ValueError as exc:
        msg = str(exc).replace(f"structured_outputs.{spec.kind}", field, 1)
        raise bad_request(msg, param=field) from None
