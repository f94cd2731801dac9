"""Request bodies of the OpenAI API (chat, completions) and of the prefix API, validated.

Validation is pydantic v2 in strict mode straight from the JSON bytes: a wrong type is an
error (``"5"`` is not an int), never silently coerced. ``parse(model, body)`` turns any
failure (malformed JSON, wrong type, missing field, out of range) into a 400 OpenAI error
naming the field in ``param``. An unknown top-level field is a 400 "Unrecognized request
argument supplied: NAME" (OpenAI's answer); OpenAI fields the gateway does not implement are
refused by name (``request_fields.py``).
Ranges follow the OpenAI API reference (https://platform.openai.com/docs/api-reference/chat).

The bounds every route's body shares (nesting, counts of messages, items, tools, values) are
checked once before any route runs, by the ingress guard (``http/json_guard.py``);
``MAX_JSON_DEPTH``, ``MAX_MESSAGES``, ``load_json`` and ``json_error`` are its names.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import pydantic_core
from prefixgate.engine.sampling_params import SamplingParams, StructuredOutputsParams
from prefixgate.gateway.http.errors import bad_request
from prefixgate.gateway.http.json_guard import (  # noqa: F401 - re-exported for the routes
    MAX_JSON_DEPTH,
    MAX_MESSAGES,
    json_error,
    load_json,
)
from prefixgate.gateway.tenancy.keys import MAX_SALT_CHARS
from prefixgate.gateway.wire.prompts import check_token_ids
from prefixgate.gateway.wire.request_fields import REFUSED, check_refused, structured_from
from prefixgate.gateway.wire.sampling import Seed, sampling_params
from prefixgate.gateway.wire.stop_strings import refuse_stop_under_constraint
from prefixgate.gateway.wire.tools import choose_tool
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

# NaN / Infinity (which JSON parsers accept as literals) are never valid values. Unknown fields
# are refused, at the top level and in every nested object (messages, parts, tool calls), by
# their dotted path (OpenAI: "Unrecognized request argument"; "Additional properties are not
# allowed" inside a message): a field that is not implemented is never ignored.
_REQUEST_CONFIG = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

MAX_N = 16  # choices per request (each is one engine request)


class PromptCacheBreakpoint(BaseModel):
    """OpenAI's ``prompt_cache_breakpoint`` on a text part: ``{"mode": "explicit", "ttl":
    "30m" | "12h"}`` (``ttl`` default: the request's ``prompt_cache_options.ttl``, 30m)."""

    model_config = _REQUEST_CONFIG
    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None


class PartCacheControl(BaseModel):
    """``cache_control`` on a text part (Anthropic's breakpoint, as OpenAI-compatible
    routers take it): ``{"type": "ephemeral", "ttl": "5m" | "1h"}``."""

    model_config = _REQUEST_CONFIG
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextPart(BaseModel):
    """One ``{"type": "text", "text": ...}`` part of a message's content, optionally a cache
    breakpoint (``prompt_cache_breakpoint`` or ``cache_control``:
    ``wire/cache_breakpoints.py``)."""

    model_config = _REQUEST_CONFIG
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None
    cache_control: PartCacheControl | None = None


class PromptCacheOptions(BaseModel):
    """``prompt_cache_options``: ``mode`` ``implicit`` (default: a breakpoint at the end of the
    messages, plus the explicit ones) or ``explicit`` (the parts' breakpoints only); ``ttl``
    only ``"30m"`` (OpenAI's one value), the breakpoints' default TTL."""

    model_config = _REQUEST_CONFIG
    mode: Literal["implicit", "explicit"] = "implicit"
    ttl: Literal["30m"] | None = None


class ToolCallFunction(BaseModel):
    """``function`` of an assistant message's tool call."""

    model_config = _REQUEST_CONFIG
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    """One tool call of an assistant message (as the API returned it)."""

    model_config = _REQUEST_CONFIG
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """A chat message. Content is a string or a list of text parts (images are refused).
    Assistant messages may carry ``tool_calls``; ``tool`` messages their ``tool_call_id``."""

    model_config = _REQUEST_CONFIG
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    # a breakpoint on the message itself, not on a part: refused by name (cache_breakpoints.py)
    prompt_cache_breakpoint: Any = None
    cache_control: Any = None
    # fields of an assistant message as openai-python returns it (``message.model_dump()``
    # given back as history): accepted when they hold nothing, refused by name otherwise
    refusal: Any = None
    audio: Any = None
    function_call: Any = None
    annotations: Any = None

    @field_validator("refusal", "audio", "function_call", "annotations", mode="after")
    @classmethod
    def _inert_only(cls, value: object, info: ValidationInfo) -> object:
        if value not in (None, []):
            raise ValueError(f"{info.field_name} is not supported in messages (only null)")
        return value

    @field_validator("content", mode="after")
    @classmethod
    def _content_required(cls, value: object, info: ValidationInfo) -> object:
        # what proxy mode checks on the raw body too (check_contents): the same words
        fault = content_fault(info.data["role"], value) if "role" in info.data else None
        if fault is not None:
            raise PydanticCustomError(_content_code(value) or "invalid_content", fault)
        return value

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        return content_text(self.content)

    def as_dict(self) -> dict[str, Any]:
        """``{"role", "content"}`` for the chat template, plus ``tool_calls`` /
        ``tool_call_id`` / ``name`` when the message has them."""
        d: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            d["name"] = self.name
        return d


_CONTENT_REQUIRED = frozenset({"system", "developer", "user", "tool"})


def content_fault(role: object, content: object) -> str | None:
    """What is wrong with a chat message's ``content`` (None: nothing), by OpenAI's rules:

    * ``null`` or absent: only an assistant turn (of tool calls) may go without content, a
      system, developer, user or tool message needs it (it was rendered as an empty turn);
    * ``[]``: an array of content parts holds at least one (``minItems: 1`` in OpenAI's API
      schema, for every role; the code ``empty_array``, as OpenAI's).

    The one rule of both modes: local mode's ``ChatMessage`` and proxy mode's raw body
    (``check_contents``), where ``role`` is the raw JSON value: a role that is no string is
    the role's fault, told by the request model, not this check's (it raised ``TypeError``
    on a list or object, a 500)."""
    if content is None and isinstance(role, str) and role in _CONTENT_REQUIRED:
        return f"a {role} message needs content (a string or text parts)"
    if isinstance(content, list) and not content:
        return "must not be empty (an array of content parts holds at least one part)"
    return None


def _content_code(content: object) -> str | None:
    """The error code of a content ``content_fault`` refuses: OpenAI's ``empty_array`` for
    ``[]``, else None."""
    return "empty_array" if isinstance(content, list) else None


def check_contents(messages: object) -> None:
    """``content_fault`` on each message of a raw chat body's ``messages`` (proxy mode, which
    relays the body unparsed; what is not a list of objects is left to the upstream).

    Raises:
        APIError: 400 naming ``messages.N.content``.
    """
    if not isinstance(messages, list):
        return
    for i, m in enumerate(messages):
        if isinstance(m, dict):
            fault = content_fault(m.get("role"), m.get("content"))
            if fault is not None:
                where = f"messages.{i}.content"
                code = _content_code(m.get("content"))
                raise bad_request(f"{where}: {fault}", param=where, code=code)


def content_text(content: object) -> str:
    """A chat message's content as one string, the gateway's one flattening: a string as it
    is, text parts (``TextPart`` or ``{"type": "text", "text": ...}`` dicts) joined, anything
    else (``None``, other parts) ``""``."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    texts = []
    for part in content:
        if isinstance(part, TextPart):
            texts.append(part.text)
        elif isinstance(part, dict) and isinstance(part.get("text"), str):
            texts.append(part["text"])
    return "".join(texts)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final usage chunk; vLLM's
    ``continuous_usage_stats`` puts the usage so far on every chunk too (``include_usage``
    then defaults to true, as in vLLM's object; beside ``include_usage: false`` a 400 naming
    it). OpenAI's ``include_obfuscation`` is taken only as ``false`` (no padding field is ever
    sent); any other key is refused by name, never ignored."""

    model_config = _REQUEST_CONFIG
    include_usage: bool | None = None
    include_obfuscation: bool | None = None
    continuous_usage_stats: bool = False

    @field_validator("continuous_usage_stats")
    @classmethod
    def _continuous_needs_usage(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("include_usage") is False:
            raise ValueError("true needs include_usage true (or absent): usage on every chunk")
        return value

    @field_validator("include_obfuscation")
    @classmethod
    def _no_obfuscation(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("true is not supported: streamed chunks carry no obfuscation field")
        return value


Stop = str | Annotated[list[str], Field(max_length=4)] | None


class _SamplingFields(BaseModel):
    """Fields shared by chat and completions (OpenAI names plus vLLM's extras)."""

    model_config = _REQUEST_CONFIG
    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Stop = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: Seed | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM-style extras (not in OpenAI's API, accepted by OpenAI clients via extra_body).
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None
    # keep the prompt's last k tokens (-1: max_model_len; over it a 400, prompts.py)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # structured outputs: vLLM's object and its older guided_* fields (request_fields.py)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # OpenAI fields accepted with no effect on generation, or only with their no-op value,
    # or refused with a non-null value (request_fields.REFUSED): checked after parsing.
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    store: bool | None = None
    service_tier: str | None = None
    metadata: Any = None
    # vLLM's per-request cache salt; the gateway nests it inside the key's own partition.
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT_CHARS)
    # vLLM's request priority (lower first; the engine's "priority" policy); keys decide.
    priority: int | None = Field(None, ge=-(2**31), le=2**31 - 1)

    @field_validator(
        "n",
        "presence_penalty",
        "frequency_penalty",
        "stream",
        "logprobs",
        "echo",
        mode="before",
        check_fields=False,
    )
    @classmethod
    def _null_is_the_default(cls, value: object, info: ValidationInfo) -> object:
        # OpenAI's spec makes these nullable: an explicit null is the field's default
        if value is None and info.field_name is not None:
            return cls.model_fields[info.field_name].default
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation_keeps_tokens(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("must be -1 (max_model_len) or at least 1 (the tokens kept)")
        return value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: Stop) -> Stop:
        if value == "" or (isinstance(value, list) and any(s == "" for s in value)):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream=true")
        return value

    @property
    def include_usage(self) -> bool:
        """True when a streamed response must end with a usage chunk."""
        so = self.stream_options
        return bool(self.stream and so and (so.include_usage or so.continuous_usage_stats))

    @property
    def continuous_usage(self) -> bool:
        """True when every chunk of a streamed response carries the usage so far (vLLM's
        ``stream_options.continuous_usage_stats``)."""
        so = self.stream_options
        return bool(self.stream and so and so.continuous_usage_stats)

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token for the engine (None = no logprobs)."""
        raise NotImplementedError

    def sampling_params(
        self,
        max_tokens: int,
        seed: int | None,
        structured: StructuredOutputsParams | None = None,
        keep_special_tokens: bool = False,
    ) -> SamplingParams:
        """The engine's ``SamplingParams`` of one choice (``seed``: the choice's own;
        ``keep_special_tokens``: the text keeps special tokens whatever the request's
        ``skip_special_tokens``, for a tool-call parser whose markers are special tokens).

        Raises:
            APIError: 400 naming the field the engine refuses.
        """
        fields = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "max_tokens": max_tokens,
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "logprobs": self.num_logprobs,
            "min_tokens": self.min_tokens,
            "logit_bias": self.logit_bias,
            "structured_outputs": structured,
            "skip_special_tokens": self.skip_special_tokens and not keep_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "bad_words": self.bad_words,
        }
        return sampling_params(fields, _OPENAI_NAMES)


_OPENAI_NAMES = {
    name: name
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "max_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "logprobs",
        "min_tokens",
        "logit_bias",
        "structured_outputs",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "bad_words",
    )
}
"""Engine field → the chat / completions field that sets it (both name them alike)."""


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. ``prefix_id`` (ours) prepends a pinned prefix's messages."""

    messages: list[ChatMessage] = Field(default_factory=list, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    prefix_id: str | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None
    audio: Any = None
    function_call: Any = None
    functions: Any = None
    moderation: Any = None
    prediction: Any = None
    prompt_cache_options: PromptCacheOptions | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    # vLLM's chat template controls (``check_template_kwargs``; both flags true is a 400)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_generate(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt", True):
            raise ValueError(
                "cannot be true with add_generation_prompt true (its default): send "
                "add_generation_prompt false to continue the final message"
            )
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs=true")
        return value

    @property
    def output_limit(self) -> int | None:
        """``max_completion_tokens`` (current name) or ``max_tokens`` (deprecated name)."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    @property
    def output_limit_param(self) -> str:
        """The field ``output_limit`` came from (what a too-large limit's 400 names)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token for the engine (None = no logprobs)."""
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


def check_chat_refused(req: ChatCompletionRequest) -> None:
    """400 naming the first field of a parsed chat request that is refused
    (``request_fields.REFUSED``; ``store``, ``service_tier`` and ``modalities`` past their
    no-op values). Local mode and proxy mode (before a ``prefix_id`` is looked up) call it.

    Raises:
        APIError: 400 ``unsupported_parameter`` naming the field.
    """
    check_refused({name: getattr(req, name, None) for name in REFUSED}, req.n)
    check_refused({k: getattr(req, k) for k in ("store", "service_tier", "modalities")}, req.n)


def check_chat_body(
    req: ChatCompletionRequest,
) -> tuple[StructuredOutputsParams | None, str | None]:
    """Check what a parsed chat body says on its own, with no model, server setting or engine
    package: its refused fields (``check_chat_refused``), its tools' form and its
    ``tool_choice`` against them (``tools.choose_tool``), its output constraint's form
    (``structured_from``) and not beside a forced tool call, ``stop`` beside a whole-output
    constraint, ``logit_bias`` / ``stop_token_ids`` as token ids. Both modes run it before a
    ``prefix_id`` is looked up, so a bad body beside an unknown prefix is the same 400 in
    both; what needs the served model (the vocabulary's bound, the tool-call parser, a
    schema's grammar, the context) is checked after the lookup (local mode) or by the
    upstream (proxy mode).

    Returns:
        The output constraint and the field it came from (``structured_from``).

    Raises:
        APIError: 400 naming the field.
    """
    check_chat_refused(req)
    check_template_kwargs(req.chat_template_kwargs)
    _, mode, _ = choose_tool(req.tools, req.tool_choice, schemas=False)
    spec, field = structured_from(req)
    forced = "tool_choice" if mode in ("required", "named") else None
    if spec is not None and forced is not None:
        raise bad_request(
            f"{field}: cannot be combined with tool_choice {req.tool_choice!r} (it constrains "
            "the output to a tool call)",
            param=field,
        )
    refuse_stop_under_constraint(req.stop, "stop", field if spec is not None else forced)
    check_token_ids(req)
    return spec, field


# Template variables the gateway sets itself: a ``chat_template_kwargs`` key never overrides
# them (the messages, the tools the answer is parsed against, the render's own switches).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
    }
)


def check_template_kwargs(kwargs: dict[str, Any] | None, tokenizer: object = None) -> None:
    """400 for a ``chat_template_kwargs`` (vLLM's: more variables for the jinja2 chat
    template, e.g. Qwen3's ``{"enable_thinking": false}``) the template may not take: a key
    the gateway sets itself (``RESERVED_TEMPLATE_KWARGS``), or, given the served
    ``tokenizer``, a string anywhere in a value that holds a special-token string (the
    template would print it as a control token: only the template's own markup and the
    messages' roles make those, ``engine.tokenizer.encode_chat``).

    Raises:
        APIError: 400 naming ``chat_template_kwargs.KEY``.
    """
    if not kwargs:
        return
    for key, value in kwargs.items():
        where = f"chat_template_kwargs.{key[:80]}"
        if key in RESERVED_TEMPLATE_KWARGS:
            raise bad_request(
                f"{where}: set by the request itself, not a chat_template_kwargs key "
                f"(reserved: {', '.join(sorted(RESERVED_TEMPLATE_KWARGS))})",
                param=where,
            )
        holds = getattr(tokenizer, "holds_special_text", None)
        if holds is not None and any(holds(s) for s in _strings(value)):
            raise bad_request(
                f"{where}: holds a special-token string (template variables are printed as "
                "markup, where it would be a control token)",
                param=where,
            )


def _strings(value: object) -> list[str]:
    """Every string in a JSON value (keys included), walked without recursion."""
    out: list[str] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict):
            out.extend(str(k) for k in v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return out


class CompletionRequest(_SamplingFields):
    """POST /v1/completions: a prompt string, token ids, or a batch of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @property
    def output_limit(self) -> int | None:
        """``max_tokens``; OpenAI's default for completions is 16 tokens."""
        return self.max_tokens if self.max_tokens is not None else 16

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token for the engine (None = no logprobs)."""
        return self.logprobs


def check_completion_body(
    req: CompletionRequest,
) -> tuple[StructuredOutputsParams | None, str | None]:
    """Check what a parsed completions body says on its own, with no model, server setting or
    engine package, in local mode's order: ``echo`` and ``suffix`` (not supported), the
    refused fields (``store``, ``service_tier``, ``best_of``, ``metadata``), its output
    constraint's form (``structured_from``), ``stop`` beside a whole-output constraint. Local
    mode runs it after the model's name; the proxy before refusing ``stop`` beside a
    constraint (``proxy.routes``), so a body with two defects is named by the same one.

    Returns:
        The output constraint and the field it came from (``structured_from``).

    Raises:
        APIError: 400 naming the field.
    """
    if req.echo:
        raise bad_request("echo is not supported", param="echo", code="unsupported_parameter")
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix", code="unsupported_parameter")
    check_refused({k: getattr(req, k) for k in ("store", "service_tier", "best_of")}, req.n)
    check_refused({"metadata": req.metadata}, req.n)
    spec, field = structured_from(req)
    refuse_stop_under_constraint(req.stop, "stop", field if spec is not None else None)
    return spec, field


class PrefixCreateRequest(BaseModel):
    """POST /v1/prefixes: the leading messages to render and pin for ``ttl_seconds``."""

    model_config = _REQUEST_CONFIG
    model: str
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    ttl_seconds: float = Field(300.0, gt=0.0)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT_CHARS)


M = TypeVar("M", bound=BaseModel)


# Top-level fields whose empty value means something: an empty prompt, input or token list is
# a request for the empty text (or refused by the model as such); OpenAI's
# ``web_search_options: {}`` turns web search on (refused here by name); an output constraint
# sent empty asks for a constraint, judged as the same one under ``structured_outputs``:
# ``guided_json: {}`` is any JSON, ``guided_choice: []``, ``guided_regex: ""``,
# ``guided_grammar: ""``, ``structured_outputs: {}`` and ``response_format: {}`` are 400s
# naming the field (dropped, they answered 200 with unconstrained text).
EMPTY_MEANS = frozenset(
    {
        "prompt",
        "input",
        "tokens",
        "web_search_options",
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    }
)


# An empty value's JSON (null, [], {}, ""), found anywhere in a body without parsing it.
_MAYBE_EMPTY = re.compile(rb'null|\[\s*\]|\{\s*\}|""')


def is_empty(value: object) -> bool:
    """True for ``null``, ``[]``, ``{}`` and ``""``: a value that says nothing."""
    return value is None or (type(value) in (list, dict, str) and not value)


def without_empty(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` without its top-level fields holding an empty value (``is_empty``), but those of
    ``EMPTY_MEANS``: every dialect answers a field's empty value as its absence."""
    return {k: v for k, v in raw.items() if k in EMPTY_MEANS or not is_empty(v)}


def parse(model: type[M], body: bytes) -> M:
    """Validate a JSON body into ``model`` (its counts bounded already by the ingress
    guard, ``http/json_guard.py``). A top-level field holding ``null``, ``[]``, ``{}`` or
    ``""`` is validated as if absent (``without_empty``).

    Raises:
        APIError: 400 with ``param`` naming the first field at fault (``code``
            ``"invalid_json"`` for malformed JSON or nesting over ``MAX_JSON_DEPTH``).
    """
    tags: frozenset[str] = getattr(model, "union_tags", frozenset())
    sent = body
    raw = None
    if _MAYBE_EMPTY.search(body):  # no empty value anywhere: nothing to drop, no parse
        try:
            raw = pydantic_core.from_json(body)
        except ValueError:
            pass  # model_validate_json reports it, naming the place
    emptied: set[str] = set()
    if isinstance(raw, dict):
        present = without_empty(raw)
        if len(present) != len(raw):  # an empty field is answered as its absence
            emptied = set(raw) - set(present)
            body = pydantic_core.to_json(present)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        # a part of a kind not taken ({"type": "image_url", "image_url": ...}): its type is the
        # fault, not the keys that belong to that kind
        wrong_kind = {e["loc"][:-1] for e in errors if e["loc"][-1:] == ("type",)}
        if wrong_kind:
            kept = [
                e
                for e in errors
                if not (e["type"] == "extra_forbidden" and e["loc"][:-1] in wrong_kind)
            ]
            errors = kept or errors
        extra = [e for e in errors if e["type"] == "extra_forbidden"]
        if extra:  # OpenAI's answer to an unknown field (nested: its dotted path)
            name = ".".join(_field_path(extra[0]["loc"], tags))[:80]
            raise bad_request(
                f"Unrecognized request argument supplied: {name}", param=name
            ) from None
        err = _relevant_error(errors)
        if err["type"] == "json_invalid":
            raise json_error(err["msg"], body) from None
        if err["type"] == "model_type" and not err["loc"]:
            raise bad_request("the body must be a JSON object", code="invalid_json") from None
        # Union members add their type name to the location ('stop', 'str'): keep field names.
        loc = _field_path(err["loc"], tags)
        param = ".".join(loc) or None
        msg = err["msg"]
        nulled = isinstance(raw, dict) and param in emptied and raw[param] is None
        if err["type"] == "missing" and nulled and param is not None:
            # a required field sent null: the wrong type it is, as for any other value
            msg = _null_fault(model, sent, param)
        elif err["type"] == "missing":
            # a required field sent empty: say so, not that it was not sent
            msg = "must not be empty" if param in emptied else "field required"
        code = "empty_array" if err["type"] == "empty_array" else None  # OpenAI's code
        raise bad_request(f"{param}: {msg}" if param else msg, param=param, code=code) from None


def _null_fault(model: type[BaseModel], body: bytes, field: str) -> str:
    """What validating ``body`` as sent (its ``null`` kept) says of the top-level required
    ``field`` sent ``null`` ("Input should be a valid string"), as for any value of a wrong
    type; "must not be null" where it says nothing of it."""
    try:
        model.model_validate_json(body)
    except ValidationError as exc:
        errors = [e for e in exc.errors(include_url=False) if e["loc"][:1] == (field,)]
        if errors:
            return _relevant_error(errors)["msg"]
    return "must not be null"


class GatewayFields(BaseModel):
    """The gateway's own fields of a chat / completions body, checked as local mode's
    ``ChatCompletionRequest`` / ``CompletionRequest`` check them: ``prefix_id`` (chat only)
    and ``cache_salt`` (1 to ``MAX_SALT_CHARS`` characters). Proxy mode forwards the rest of
    the body as it came."""

    model_config = ConfigDict(extra="ignore")
    prefix_id: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT_CHARS)


GATEWAY_FIELDS = ("prefix_id", "cache_salt")


def gateway_fields(raw: dict[str, Any], chat: bool) -> tuple[GatewayFields, dict[str, Any]]:
    """Check a chat (``chat``) or completions body's ``GatewayFields`` with ``parse``'s rules
    and words (an empty value is its absence), so proxy mode answers a bad one as local mode
    does; returns them and ``raw`` without those sent empty.

    Raises:
        APIError: 400 naming the field (``prefix_id`` on a completions body: an unknown
            field, as local mode says).
    """
    sent = {k: raw[k] for k in GATEWAY_FIELDS if k in raw}
    present = without_empty(sent)
    if not chat and "prefix_id" in present:
        raise bad_request("Unrecognized request argument supplied: prefix_id", param="prefix_id")
    fields = parse(GatewayFields, pydantic_core.to_json(present))
    if len(present) != len(sent):
        raw = {k: v for k, v in raw.items() if k not in sent or k in present}
    return fields, raw


def _relevant_error(errors: list[ErrorDetails]) -> ErrorDetails:
    """The error to report: the first field's, and for a union field (``stop``, ``prompt``,
    ``content``) the error of the member that accepts the kind of value sent (a list of 100
    stop strings is "too long", not "not a string"), the deepest one, else the first."""
    first = errors[0]
    loc = first["loc"]
    cut = next((i for i, p in enumerate(loc) if _is_type_tag(p)), len(loc))
    field = loc[:cut]
    same = [e for e in errors if e["loc"][:cut] == field]
    # "<member>: Input should be a valid <type>": that member does not take this value at all.
    fitting = [
        e
        for e in same
        if not (e["type"].endswith("_type") and e["loc"] and _is_type_tag(e["loc"][-1]))
    ]
    if not fitting or cut == len(loc):
        return first
    return max(fitting, key=lambda e: len(e["loc"]))  # max keeps the first of equal depth


def _field_path(loc: tuple[int | str, ...], tags: frozenset[str]) -> list[str]:
    """``loc`` without the union members' names pydantic adds: type tags (``str``,
    ``list[...]``) and, right after a list index, a discriminated union's tag (the model's
    ``union_tags``: ``messages.0.content.0.text.foo`` is ``messages.0.content.0.foo``)."""
    out: list[str] = []
    for i, p in enumerate(loc):
        tag = p in tags and 0 < i < len(loc) - 1 and isinstance(loc[i - 1], int)
        if tag or _is_type_tag(p):  # a tag is never last: the error is inside its member
            continue
        out.append(str(p))
    return out


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and (
        part in {"str", "int", "float", "bool", "none"}
        or part.startswith(("list[", "function-"))
        or part in {"TextPart"}
    )
