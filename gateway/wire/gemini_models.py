"""Gemini's API request bodies (``v1beta``), validated, and their conversion to a chat.

The routes (``gemini.py``) take Gemini's camelCase JSON, as ``google-genai`` sends it:

* ``GenerateContentRequest``: ``contents`` (turns of role ``user`` / ``model``, a missing role
  read as ``user``; parts ``text``, ``functionCall``, ``functionResponse``),
  ``systemInstruction`` (text parts), ``generationConfig`` (``maxOutputTokens``,
  ``temperature``, ``topP``, ``topK``, ``stopSequences``, ``candidateCount``, ``seed``,
  ``presencePenalty``, ``frequencyPenalty``, ``responseMimeType`` ``text/plain`` or
  ``application/json`` with ``responseSchema`` (Gemini's OpenAPI-subset schema) or
  ``responseJsonSchema`` (a JSON schema)), ``tools`` (``functionDeclarations`` only),
  ``toolConfig.functionCallingConfig`` (``AUTO`` / ``ANY`` / ``NONE``,
  ``allowedFunctionNames``), ``safetySettings`` (taken, not applied: no safety filter runs),
  ``cachedContent`` (a ``cachedContents/...`` name);
* ``CountTokensRequest``: ``contents`` or ``generateContentRequest``;
* ``CachedContentCreate`` / ``CachedContentUpdate``: the ``cachedContents`` resource
  (``model``, ``systemInstruction``, ``contents``, ``tools``, ``toolConfig``, ``ttl`` or
  ``expireTime``, ``displayName``).

As protobuf's JSON mapping reads Google's API, every field is also taken under its snake_case
name (``thinking_budget``: google-genai sends ``thinkingConfig`` so) and an integer field as an
integral number (``5.0``: google-genai sends ``top_k`` so), but not under both names in one
object (``GeminiObject``); ``thinkingConfig`` is taken when
it asks for no thinking (``thinkingBudget: 0``).

Anything else is a 400 naming the field (unknown fields at every level: images, files,
``thinkingConfig`` asking for thinking, ``responseModalities``, ``responseLogprobs``, search
and code tools, ``VALIDATED`` function calling, ...). ``to_chat`` turns a request into the chat the gateway
already serves (messages, OpenAI-shaped function tools, a ``tool_choice``), so a Gemini
request renders into the same token ids as the equivalent chat completion.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

from prefixgate.engine.sampling_params import SamplingParams, StructuredOutputsParams
from prefixgate.gateway.http.errors import bad_request
from prefixgate.gateway.wire.gemini_routes import DEFAULT_CACHE_TTL_S
from prefixgate.gateway.wire.sampling import Seed, StopString, sampling_params
from pydantic import (
    AliasChoices,
    AliasGenerator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_snake
from pydantic_core import PydanticCustomError

# Every field also under its snake_case name: protobuf's JSON mapping reads both (google-genai
# sends ``thinkingConfig``'s fields so).
_BOTH_NAMES = AliasGenerator(validation_alias=lambda name: AliasChoices(name, to_snake(name)))
_CONFIG = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, alias_generator=_BOTH_NAMES)
_OPEN = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class GeminiObject(BaseModel):
    """An object of Gemini's API: each field under its camelCase or its snake_case name
    (``_BOTH_NAMES``), not both.

    Raises:
        ValidationError: ``both_spellings`` naming the two names, when an object holds both
            (one of the two values would be dropped without a word).
    """

    model_config = _CONFIG

    @model_validator(mode="before")
    @classmethod
    def _one_name_each(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in cls.model_fields:
                snake = to_snake(name)
                if snake != name and name in data and snake in data:
                    raise PydanticCustomError(
                        "both_spellings",
                        "{camel} and {snake} are one field under both its names: send one",
                        {"camel": name, "snake": snake},
                    )
        return data


MAX_CANDIDATES = 8  # Gemini's candidateCount bound


def _integral(value: Any) -> Any:
    """A JSON number with an integral value as the int it is (``5.0`` → ``5``), as protobuf's
    JSON mapping reads an integer field (google-genai types ``top_k`` as a float, so sends
    ``5.0``); anything else unchanged, for the strict ``int`` check to refuse by name."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


ProtoInt = Annotated[int, BeforeValidator(_integral)]
"""An integer field of Gemini's API: an int, or a float with an integral value."""


class FunctionCall(GeminiObject):
    """``functionCall`` part: ``{"name", "args", "id"?}`` (an earlier call of the model)."""

    name: str = Field(min_length=1)
    args: dict[str, Any] | None = None
    id: str | None = None


class FunctionResponse(GeminiObject):
    """``functionResponse`` part: ``{"name", "response", "id"?}`` (a function's answer)."""

    name: str = Field(min_length=1)
    response: dict[str, Any]
    id: str | None = None


class Part(GeminiObject):
    """One part: exactly one of ``text``, ``functionCall``, ``functionResponse``."""

    text: str | None = None
    functionCall: FunctionCall | None = None
    functionResponse: FunctionResponse | None = None


class Content(GeminiObject):
    """A turn: ``role`` ``user`` / ``model`` (absent: ``user``) and its ``parts``."""

    role: Literal["user", "model"] | None = None
    parts: list[Part] = Field(min_length=1)


class SystemInstruction(GeminiObject):
    """``systemInstruction``: text parts (``role`` is ignored by Gemini; taken as sent)."""

    role: str | None = None
    parts: list[Part] = Field(min_length=1)


class ThinkingConfig(GeminiObject):
    """``generationConfig.thinkingConfig``: taken only when it asks for no thinking
    (``thinkingBudget: 0``, ``includeThoughts`` false or absent), which is what a model
    without a thinking phase does; any thinking asked for is a 400 naming the field, as
    Gemini answers for a model that cannot think."""

    thinkingBudget: ProtoInt | None = None
    includeThoughts: bool | None = None

    @model_validator(mode="after")
    def _no_thinking(self) -> ThinkingConfig:
        if self.includeThoughts:
            raise ValueError(
                "includeThoughts: thinking is not supported (send thinkingBudget 0, or no "
                "thinkingConfig)"
            )
        if self.thinkingBudget is not None and self.thinkingBudget != 0:
            raise ValueError(
                f"thinkingBudget: thinking is not supported, got {self.thinkingBudget} (send "
                "thinkingBudget 0, or no thinkingConfig)"
            )
        return self


class GenerationConfig(GeminiObject):
    """``generationConfig``: the sampling and output fields taken (module docstring)."""

    maxOutputTokens: ProtoInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    topP: float | None = Field(None, gt=0.0, le=1.0)
    topK: ProtoInt | None = Field(None, ge=1)
    stopSequences: list[StopString] | None = Field(None, max_length=5)
    candidateCount: ProtoInt | None = Field(None, ge=1, le=MAX_CANDIDATES)
    seed: Annotated[Seed, BeforeValidator(_integral)] | None = None
    presencePenalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequencyPenalty: float | None = Field(None, ge=-2.0, le=2.0)
    responseMimeType: str | None = None
    responseSchema: dict[str, Any] | None = None
    responseJsonSchema: dict[str, Any] | None = None
    thinkingConfig: ThinkingConfig | None = None

    def sampling_params(
        self,
        max_tokens: int,
        seed: int | None,
        stop: list[str],
        structured: StructuredOutputsParams | None,
        skip_special_tokens: bool,
    ) -> SamplingParams:
        """The engine's ``SamplingParams`` of one candidate (``seed``: its own; ``stop``:
        the checked ``stopSequences``).

        Raises:
            APIError: 400 naming the ``generationConfig`` field the engine refuses.
        """
        fields = {
            "temperature": self.temperature,
            "top_p": self.topP,
            "top_k": self.topK,
            "seed": seed,
            "presence_penalty": self.presencePenalty,
            "frequency_penalty": self.frequencyPenalty,
            "max_tokens": max_tokens,
            "stop": stop,
            "structured_outputs": structured,
            "skip_special_tokens": skip_special_tokens,
        }
        return sampling_params(fields, _GEMINI_NAMES, prefix="generationConfig.")


_GEMINI_NAMES = {
    "temperature": "temperature",
    "top_p": "topP",
    "top_k": "topK",
    "seed": "seed",
    "presence_penalty": "presencePenalty",
    "frequency_penalty": "frequencyPenalty",
    "max_tokens": "maxOutputTokens",
    "stop": "stopSequences",
}
"""Engine field → the ``generationConfig`` field that sets it."""

CHAT_FIELD_IN_GEMINI = {
    **{name: f"generationConfig.{field}" for name, field in _GEMINI_NAMES.items()},
    "n": "generationConfig.candidateCount",
    "messages": "contents",
    "max_completion_tokens": "generationConfig.maxOutputTokens",
}
"""A chat completions field (what the proxy sends an OpenAI-style upstream) → the Gemini
request field it came from, for naming an upstream's refusal in the client's words."""


class FunctionDeclaration(GeminiObject):
    """A function the model may call: ``name``, ``description``, ``parameters`` (Gemini's
    schema) or ``parametersJsonSchema`` (a JSON schema)."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    parametersJsonSchema: dict[str, Any] | None = None


class Tool(GeminiObject):
    """A tool: ``functionDeclarations`` only (search, code execution, ... are refused)."""

    functionDeclarations: list[FunctionDeclaration] | None = None


class FunctionCallingConfig(GeminiObject):
    """``toolConfig.functionCallingConfig``: ``mode`` and ``allowedFunctionNames``."""

    mode: Literal["AUTO", "ANY", "NONE", "MODE_UNSPECIFIED"] | None = None
    allowedFunctionNames: list[str] | None = None


class ToolConfig(GeminiObject):
    """``toolConfig``: ``functionCallingConfig`` only."""

    functionCallingConfig: FunctionCallingConfig | None = None


class SafetySetting(GeminiObject):
    """``safetySettings`` entry (taken, not applied: no safety filter runs here)."""

    category: str
    threshold: str
    method: str | None = None


class GenerateContentRequest(GeminiObject):
    """POST ``models/{model}:generateContent`` / ``:streamGenerateContent``."""

    model: str | None = None  # inside countTokens' generateContentRequest
    contents: list[Content] = Field(min_length=1)
    systemInstruction: SystemInstruction | None = None
    generationConfig: GenerationConfig | None = None
    tools: list[Tool] | None = None
    toolConfig: ToolConfig | None = None
    safetySettings: list[SafetySetting] | None = None
    cachedContent: str | None = None


class CountTokensRequest(GeminiObject):
    """POST ``models/{model}:countTokens``: ``contents``, or a whole ``generateContentRequest``."""

    contents: list[Content] | None = None
    generateContentRequest: GenerateContentRequest | None = None

    @field_validator("generateContentRequest", mode="before")
    @classmethod
    def _inner_empty_is_absent(cls, value: Any) -> Any:
        """A whole ``generateContent`` body: its fields' empty values are their absence, as
        on ``generateContent`` (``request_models.without_empty``)."""
        from prefixgate.gateway.wire.request_models import without_empty  # noqa: PLC0415

        return without_empty(value) if isinstance(value, dict) else value

    def request(self) -> GenerateContentRequest:
        """The request whose prompt is counted (both modes' ``countTokens``).

        Raises:
            APIError: 400 naming ``contents``: neither given (an empty ``contents`` is none,
                as ``generateContent`` says), or both.
        """
        if self.contents is None and self.generateContentRequest is None:
            raise bad_request(
                "contents: must not be empty (give contents, or a generateContentRequest)",
                param="contents",
            )
        if self.generateContentRequest is None:
            return GenerateContentRequest(contents=self.contents or [])
        if self.contents is not None:
            raise bad_request(
                "contents: give contents or generateContentRequest, not both", param="contents"
            )
        return self.generateContentRequest


class CachedContentCreate(GeminiObject):
    """POST ``cachedContents``: the content to pin and its life (``ttl`` like ``"300s"``, or
    ``expireTime`` RFC 3339)."""

    model: str
    systemInstruction: SystemInstruction | None = None
    contents: list[Content] | None = None
    tools: list[Tool] | None = None
    toolConfig: ToolConfig | None = None
    ttl: str | None = None
    expireTime: str | None = None
    displayName: str | None = Field(None, max_length=128)


class CachedContentUpdate(GeminiObject):
    """PATCH ``cachedContents/{id}``: a new ``ttl`` or ``expireTime`` (only the life changes)."""

    ttl: str | None = None
    expireTime: str | None = None


M = TypeVar("M", bound=BaseModel)


def present(value: Any) -> bool:
    """Whether a field holds something: ``None``, ``""``, ``[]`` and an object of nothing
    (``{}``, a model with every field unset) count as absent, as in the other dialects."""
    if isinstance(value, BaseModel):
        return any(present(v) for v in value.__dict__.values())
    return value not in (None, "", [], {})


def parse_request(model: type[M], body: bytes) -> M:
    """Validate a body (``request_models.parse``, 400 naming the field). Size, depth and counts
    (``contents`` at any depth, countTokens' ``generateContentRequest.contents`` too) were
    bounded before, by the ingress guard (``http.json_guard``) every route passes.

    Raises:
        APIError: 400 naming the field.
    """
    from prefixgate.gateway.wire.request_models import parse  # the shared JSON → 400 mapping

    return parse(model, body)


_DURATION = re.compile(r"^([0-9]+(?:\.[0-9]{1,9})?)s$")


def life_seconds(ttl: str | None, expire_time: str | None, default_s: float) -> float:
    """Seconds a cache lives: ``ttl`` (protobuf Duration JSON, ``"300s"``, ``"1.5s"``) or
    ``expireTime`` (RFC 3339, e.g. ``"2026-01-01T00:00:00Z"``) from now; ``default_s`` when
    neither is given.

    Raises:
        APIError: 400 naming the field: both given, malformed, or not in the future.
    """
    ttl, expire_time = ttl or None, expire_time or None  # empty: absent
    if ttl is not None and expire_time is not None:
        raise bad_request("ttl and expireTime: give one, not both", param="ttl")
    if ttl is not None:
        m = _DURATION.match(ttl)
        if m is None:
            raise bad_request(f"ttl: {ttl[:40]!r} is not a duration such as '300s'", param="ttl")
        seconds = float(m.group(1))
        if seconds <= 0:
            raise bad_request("ttl: must be more than 0s", param="ttl")
        return seconds
    if expire_time is not None:
        try:
            at = dt.datetime.fromisoformat(expire_time.replace("Z", "+00:00"))
        except ValueError:
            raise bad_request(
                f"expireTime: {expire_time[:40]!r} is not an RFC 3339 time", param="expireTime"
            ) from None
        if at.tzinfo is None:
            raise bad_request("expireTime: needs a time zone (e.g. 'Z')", param="expireTime")
        seconds = (at - dt.datetime.now(dt.UTC)).total_seconds()
        if seconds <= 0:
            raise bad_request("expireTime: must be in the future", param="expireTime")
        return seconds
    return default_s


# --- Gemini's schema (an OpenAPI 3.0 subset) → JSON schema -----------------------------------
_SCHEMA_KEYS = {
    "type",
    "format",
    "title",
    "description",
    "nullable",
    "enum",
    "maxItems",
    "minItems",
    "properties",
    "required",
    "minProperties",
    "maxProperties",
    "minLength",
    "maxLength",
    "pattern",
    "example",
    "anyOf",
    "propertyOrdering",
    "default",
    "items",
    "minimum",
    "maximum",
}
_TYPES = {"STRING", "NUMBER", "INTEGER", "BOOLEAN", "ARRAY", "OBJECT", "NULL"}


def _camel(name: str) -> str:
    """``max_length`` → ``maxLength`` (a proto field name as its JSON name)."""
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def json_schema(schema: Any, where: str) -> dict[str, Any]:
    """Gemini's ``Schema`` as a JSON schema (keys in their JSON or proto spelling:
    ``maxLength`` or ``max_length``): ``type`` lower-cased (``nullable`` adds ``"null"``), ``properties`` / ``items`` / ``anyOf`` converted, ``propertyOrdering`` and
    ``example`` dropped (they change no valid output).

    Raises:
        APIError: 400 naming the key at ``where`` that Gemini's schema does not have.
    """
    if not isinstance(schema, dict):
        raise bad_request(f"{where}: a schema must be an object", param=where)
    out: dict[str, Any] = {}
    seen: dict[str, str] = {}  # a key's JSON name -> the spelling it came in
    for name, value in schema.items():
        here = f"{where}.{name}"
        key = _camel(name)  # protobuf JSON takes a field's proto name too (google-genai sends it)
        if key not in _SCHEMA_KEYS:
            raise bad_request(f"{here}: not a field of Gemini's Schema", param=here)
        if key in seen:  # as the request objects: one of the two values would be dropped
            raise bad_request(
                f"{where}: {seen[key]} and {name} are one field under both its names: send one",
                param=f"{where}.{name}",
            )
        seen[key] = name
        if key in ("propertyOrdering", "example"):
            continue
        if key == "type":
            if not isinstance(value, str) or value.upper() not in _TYPES:
                raise bad_request(f"{here}: must be one of {sorted(_TYPES)}", param=here)
            out["type"] = value.lower()
        elif key == "properties":
            if not isinstance(value, dict):
                raise bad_request(f"{here}: must be an object", param=here)
            out["properties"] = {k: json_schema(v, f"{here}.{k}") for k, v in value.items()}
        elif key == "items":
            out["items"] = json_schema(value, here)
        elif key == "anyOf":
            if not isinstance(value, list):
                raise bad_request(f"{here}: must be a list", param=here)
            out["anyOf"] = [json_schema(v, f"{here}.{i}") for i, v in enumerate(value)]
        elif key != "nullable":
            out[key] = value
    if schema.get("nullable") is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def structured(config: GenerationConfig | None) -> StructuredOutputsParams | None:
    """The constraint of ``responseMimeType`` + ``responseSchema`` / ``responseJsonSchema``:
    ``application/json`` alone is any JSON object, with a schema that schema; ``text/plain``
    (or none) nothing.

    Raises:
        APIError: 400 naming the field: another mime type, a schema without
            ``application/json``, both schemas.
    """
    if config is None:
        return None
    mime = config.responseMimeType or None
    where = "generationConfig."
    if mime not in (None, "text/plain", "application/json"):
        raise bad_request(
            f"{where}responseMimeType: {mime[:60]!r} is not supported (text/plain, "
            "application/json)",
            param=f"{where}responseMimeType",
        )
    schemas = [
        n for n in ("responseSchema", "responseJsonSchema") if getattr(config, n) is not None
    ]
    if len(schemas) > 1:
        raise bad_request(
            f"{where}responseSchema and responseJsonSchema: give one",
            param=f"{where}responseSchema",
        )
    if schemas and mime != "application/json":
        raise bad_request(
            f"{where}{schemas[0]}: needs responseMimeType 'application/json'",
            param=f"{where}{schemas[0]}",
        )
    if mime != "application/json":
        return None
    if config.responseJsonSchema is not None:
        return StructuredOutputsParams(json=config.responseJsonSchema)
    if config.responseSchema is not None:
        return StructuredOutputsParams(
            json=json_schema(config.responseSchema, f"{where}responseSchema")
        )
    return StructuredOutputsParams(json_object=True)


def refuse_constraint_beside_tools(
    constraint: StructuredOutputsParams | None, tools: list[dict[str, Any]], choice: Any
) -> None:
    """A JSON response (``structured``: ``responseMimeType`` 'application/json', with or
    without a schema) is not served beside tools the model may call (``choice``, the chat's
    ``tool_choice``, anything but ``"none"``): the answer is one or the other. The same check
    in both modes, so a request local mode refuses is not relayed by a proxy.

    Raises:
        APIError: 400 naming ``generationConfig.responseMimeType``.
    """
    if constraint is not None and tools and choice != "none":
        raise bad_request(
            "generationConfig.responseMimeType: a JSON response (application/json, with or "
            "without a schema) together with tools is not supported: send one or the other, "
            "or toolConfig.functionCallingConfig.mode NONE",
            param="generationConfig.responseMimeType",
        )


# --- the chat -------------------------------------------------------------------------------
@dataclass(slots=True)
class Chat:
    """A Gemini request as a chat: template messages, OpenAI function tools and the
    ``tool_choice`` for ``tools.plan_tools``."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = None
    # the client's path of each message (``systemInstruction``, ``contents.I``, a
    # functionResponse part's ``contents.I.parts.J``): an upstream's refusal in its words
    origins: list[str] = field(default_factory=list)


def openai_tools(tools: list[Tool] | None, where: str = "tools") -> list[dict[str, Any]]:
    """``functionDeclarations`` as OpenAI function tools (``parameters`` a JSON schema).

    Raises:
        APIError: 400 naming the field: both ``parameters`` and ``parametersJsonSchema``, a
            bad schema, a name used twice.
    """
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, t in enumerate(tools or []):
        for j, f in enumerate(t.functionDeclarations or []):
            here = f"{where}.{i}.functionDeclarations.{j}"
            if f.parameters is not None and f.parametersJsonSchema is not None:
                raise bad_request(
                    f"{here}: give parameters or parametersJsonSchema, not both",
                    param=f"{here}.parameters",
                )
            if f.name in seen:
                raise bad_request(f"{here}.name: {f.name!r} is declared twice", f"{here}.name")
            seen.add(f.name)
            if f.parametersJsonSchema is not None:
                params = f.parametersJsonSchema
            elif f.parameters is not None:
                params = json_schema(f.parameters, f"{here}.parameters")
            else:
                params = {"type": "object", "properties": {}}
            fn: dict[str, Any] = {"name": f.name, "parameters": params}
            if f.description is not None:
                fn["description"] = f.description
            out.append({"type": "function", "function": fn})
    return out


def tool_choice(config: ToolConfig | None, tools: list[dict[str, Any]]) -> Any:
    """``functionCallingConfig`` as OpenAI's ``tool_choice`` (``AUTO`` → ``"auto"``, ``NONE``
    → ``"none"``, ``ANY`` → ``"required"``, or that function when one is declared or
    allowed); ``allowedFunctionNames`` under ``ANY`` keeps only those tools (``tools`` is cut
    in place).

    Raises:
        APIError: 400 naming the field: ``allowedFunctionNames`` outside ``ANY`` or naming an
            undeclared function; a mode without tools.
    """
    fc = config.functionCallingConfig if config is not None else None
    if fc is None or fc.mode in (None, "MODE_UNSPECIFIED"):
        if fc is not None and fc.allowedFunctionNames:
            raise bad_request(
                "toolConfig.functionCallingConfig.allowedFunctionNames: only with mode ANY",
                param="toolConfig.functionCallingConfig.allowedFunctionNames",
            )
        return None
    where = "toolConfig.functionCallingConfig"
    if not tools and fc.mode != "NONE":
        raise bad_request(f"{where}.mode: {fc.mode} needs tools", param=f"{where}.mode")
    names = fc.allowedFunctionNames
    if names and fc.mode != "ANY":
        raise bad_request(
            f"{where}.allowedFunctionNames: only with mode ANY",
            param=f"{where}.allowedFunctionNames",
        )
    if fc.mode == "NONE":
        return "none"
    if fc.mode == "AUTO":
        return "auto"
    if names:
        declared = {t["function"]["name"] for t in tools}
        for k, n in enumerate(names):
            if n not in declared:
                raise bad_request(
                    f"{where}.allowedFunctionNames.{k}: {n[:64]!r} is not a declared function",
                    param=f"{where}.allowedFunctionNames.{k}",
                )
        tools[:] = [t for t in tools if t["function"]["name"] in names]
    if len(tools) == 1:
        return {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
    return "required"


def system_text(system: SystemInstruction | None, where: str = "systemInstruction") -> str:
    """The system instruction's text parts joined.

    Raises:
        APIError: 400 naming a part that is not text.
    """
    if system is None:
        return ""
    text = ""
    for j, p in enumerate(system.parts):
        if p.text is None or p.functionCall is not None or p.functionResponse is not None:
            raise bad_request(f"{where}.parts.{j}: only text parts", param=f"{where}.parts.{j}")
        text += p.text
    return text


def turns(
    contents: list[Content], where: str = "contents", origins: list[str] | None = None
) -> list[dict[str, Any]]:
    """``contents`` as chat messages: a ``user`` turn's text as a user message (its
    ``functionResponse`` parts as ``tool`` messages first, answering the previous model turn's
    calls by ``id`` or else by name, in order), a ``model`` turn's text and ``functionCall``
    parts as an assistant message with ``tool_calls`` (``arguments`` objects, as templates
    take them; ``wire_messages`` for an OpenAI body).

    ``origins``, when given, gains each message's path (``contents.I``, or a tool message's
    ``contents.I.parts.J``).

    Raises:
        APIError: 400 naming the part: a part with none or more than one of text /
            functionCall / functionResponse, a functionCall in a user turn, a functionResponse
            in a model turn or answering no call.
    """
    msgs: list[dict[str, Any]] = []
    paths: list[str] = [] if origins is None else origins
    asked: list[tuple[str, str]] = []  # (id, name) of the previous model turn's calls
    n_calls = 0
    for i, c in enumerate(contents):
        role = c.role or "user"
        text = ""
        calls: list[dict[str, Any]] = []
        answered: list[dict[str, Any]] = []
        for j, p in enumerate(c.parts):
            here = f"{where}.{i}.parts.{j}"
            kinds = [
                k for k in ("text", "functionCall", "functionResponse") if getattr(p, k) is not None
            ]
            if len(kinds) != 1:
                raise bad_request(
                    f"{here}: a part holds exactly one of text, functionCall, functionResponse",
                    param=here,
                )
            if p.text is not None:
                text += p.text
            elif p.functionCall is not None:
                if role != "model":
                    raise bad_request(f"{here}.functionCall: only in model turns", here)
                call_id = p.functionCall.id or f"call_{n_calls}"
                n_calls += 1
                # arguments as an object: templates index into them (``tools.template_messages``)
                args = dict(p.functionCall.args or {})
                calls.append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": p.functionCall.name, "arguments": args},
                    }
                )
            else:
                fr = p.functionResponse
                assert fr is not None
                if role != "user":
                    raise bad_request(f"{here}.functionResponse: only in user turns", here)
                match = next(
                    (a for a in asked if (a[0] == fr.id if fr.id else a[1] == fr.name)),
                    None,
                )
                if match is None:
                    raise bad_request(
                        f"{here}.functionResponse: answers no functionCall of the previous "
                        f"model turn (name {fr.name[:64]!r})",
                        param=f"{here}.functionResponse",
                    )
                asked.remove(match)
                paths.append(here)
                answered.append(
                    {
                        "role": "tool",
                        "tool_call_id": match[0],
                        "content": json.dumps(fr.response, ensure_ascii=False),
                    }
                )
        msgs += answered
        if role == "model":
            m: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                m["tool_calls"] = calls
            msgs.append(m)
            paths.append(f"{where}.{i}")
            asked = [(c["id"], c["function"]["name"]) for c in calls]
        else:
            if text or not answered:
                msgs.append({"role": "user", "content": text})
                paths.append(f"{where}.{i}")
            asked = []
    return msgs


def wire_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Template messages (``turns``) as an OpenAI chat body sends them: tool call
    ``arguments`` as JSON text, an assistant turn of calls only with ``content`` null."""
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = m.get("tool_calls")
        if not calls:
            out.append(m)
            continue
        wire = [
            {
                **c,
                "function": {
                    "name": c["function"]["name"],
                    "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False),
                },
            }
            for c in calls
        ]
        out.append({**m, "tool_calls": wire, "content": m.get("content") or None})
    return out


def chat_messages(
    system: SystemInstruction | None,
    contents: list[Content],
    origins: list[str] | None = None,
) -> list[dict[str, Any]]:
    """The system message (when ``system`` has text), then the turns of ``contents``;
    ``origins``, when given, gains each message's path in the Gemini body (``turns``'s).

    Raises:
        APIError: 400 naming the field (``system_text``, ``turns``).
    """
    msgs: list[dict[str, Any]] = []
    text = system_text(system)
    if text:
        msgs.append({"role": "system", "content": text})
        if origins is not None:
            origins.append("systemInstruction")
    return msgs + turns(contents, origins=origins)


def cache_messages(req: CachedContentCreate) -> list[dict[str, Any]]:
    """A cache's messages (``chat_messages`` of its ``systemInstruction`` and ``contents``).

    Raises:
        APIError: 400 when it has neither, or naming the field ``chat_messages`` refuses.
    """
    messages = chat_messages(req.systemInstruction, req.contents or [])
    if not messages:
        raise bad_request("contents: a cache needs systemInstruction or contents", "contents")
    return messages


def cache_life_s(req: CachedContentCreate, max_ttl_s: float) -> float:
    """A cache's life in seconds (``ttl`` or ``expireTime``, else the default bounded by
    ``max_ttl_s``).

    Raises:
        APIError: 400 naming ``ttl`` / ``expireTime`` when it asks for more than ``max_ttl_s``.
    """
    ttl_s = life_seconds(req.ttl, req.expireTime, min(DEFAULT_CACHE_TTL_S, max_ttl_s))
    if ttl_s > max_ttl_s:
        where = "ttl" if req.ttl is not None else "expireTime"
        raise bad_request(f"{where}: a cache lives at most {max_ttl_s:g} s here", param=where)
    return ttl_s


def refuse_beside_cache(req: GenerateContentRequest) -> None:
    """A request on a ``cachedContent`` may not set what the cache holds.

    Raises:
        APIError: 400 naming ``systemInstruction`` / ``tools`` / ``toolConfig`` when set beside
            ``cachedContent``.
    """
    if not req.cachedContent:
        return
    for name in ("systemInstruction", "tools", "toolConfig"):
        if present(getattr(req, name)):
            raise bad_request(
                f"{name}: CachedContent can not be used with GenerateContent request setting "
                "system_instruction, tools or tool_config; put them in the cache",
                param=name,
            )


def to_chat(req: GenerateContentRequest) -> Chat:
    """The request as a chat: the system message, the turns, the tools and ``tool_choice``.

    Raises:
        APIError: 400 naming the field (``turns``, ``openai_tools``, ``tool_choice``), or a
            conversation ending with a model turn.
    """
    origins: list[str] = []
    msgs = chat_messages(req.systemInstruction, req.contents, origins)
    last = len(req.contents) - 1
    if (req.contents[last].role or "user") != "user":
        raise bad_request(
            f"contents.{last}.role: the conversation must end with a user turn (continuing "
            "the model's text is not supported)",
            param=f"contents.{last}.role",
        )
    tools = openai_tools(req.tools)
    choice = tool_choice(req.toolConfig, tools)
    return Chat(msgs, tools, choice, origins)
