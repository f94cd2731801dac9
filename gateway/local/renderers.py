"""Engine outputs to OpenAI bodies: one renderer for chat completions, one for completions.

The exchange (``routes_openai.Exchange``) runs the engine requests of an HTTP request and keeps
what each choice has produced (``generation.CompletionOutput``); a renderer turns that into the
route's wire shapes (``responses``): the whole body at the end, or a stream's chunks as
outputs come. Both renderers have the same methods (``opening``, ``chunk``, ``usage_chunk``,
``body``, ``event``), so the exchange never asks which route it serves.

Logprobs are natural logs of the raw model distribution; a token's text is what it adds
inside the sequence (``TokenTexts``). Finish reasons pass through (``"stop"``, ``"length"``,
and ``"abort"`` as vLLM reports it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

from prefixgate.engine.outputs import CompletionOutput, StepOutput, TokenLogprobs
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.http.sse import DONE, encode_data, encode_event
from prefixgate.gateway.local.token_texts import TokenTexts
from prefixgate.gateway.wire.response_models import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChoiceDelta,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
    dump,
)
from prefixgate.gateway.wire.tools import ToolDeltas, ToolPlan, parse_output, tool_finish_reason


def _info(token_text: Callable[[int], str], token_id: int) -> tuple[str, list[int]]:
    """``(text, bytes)`` of a token: ``TokenTexts.info``, or any token → text function's text
    and its UTF-8 bytes."""
    if isinstance(token_text, TokenTexts):
        return token_text.info(token_id)
    text = token_text(token_id)
    return text, list(text.encode())


def chat_logprobs(token_text: Callable[[int], str], entries: list[TokenLogprobs]) -> ChatLogprobs:
    """Chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for entry in entries:
        token, raw = _info(token_text, entry.sampled.token_id)
        tops = []
        for alt in entry.top:
            alt_text, alt_raw = _info(token_text, alt.token_id)
            tops.append(TopLogprob(token=alt_text, logprob=alt.logprob, bytes=alt_raw))
        content.append(
            TokenLogprob(token=token, logprob=entry.sampled.logprob, bytes=raw, top_logprobs=tops)
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    token_text: Callable[[int], str], entries: list[TokenLogprobs], offset: int = 0
) -> CompletionLogprobs:
    """Legacy completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset
    (``offset``: characters of the choice's text before these tokens). Two alternatives with
    one text are never merged: the second is keyed ``"token_id:<id>"`` (vLLM's id form)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for entry in entries:
        text = token_text(entry.sampled.token_id)
        tokens.append(text)
        token_logprobs.append(entry.sampled.logprob)
        top: dict[str, float] = {}
        for alt in entry.top:
            key = token_text(alt.token_id)
            if key in top:
                key = f"token_id:{alt.token_id}"
            top[key] = alt.logprob
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops, text_offset=offsets
    )


@dataclass(slots=True, eq=False)
class _Renderer:
    """What both renderers share: the response's identity and the stream's options.

    Args:
        rid: the response id; created: Unix seconds; model: the served model id.
        token_text: token id → text (``TokenTexts``).
        num_logprobs: alternatives per token, None when logprobs were not asked for.
        include_usage: the stream ends with a usage chunk (and other chunks carry
            ``usage: null``).
        continuous_usage: every chunk carries the usage so far (vLLM's
            ``continuous_usage_stats``; set by the exchange, ``with_usage``).
    """

    route: ClassVar[Literal["chat", "completions"]]
    _chunk_type: ClassVar[type[ChatCompletionChunk] | type[Completion]]
    _never_on_chunks: ClassVar[frozenset[str]] = frozenset()

    rid: str
    created: int
    model: str
    token_text: Callable[[int], str]
    num_logprobs: int | None
    include_usage: bool
    continuous_usage: bool = False
    _chunk_exclude: set[str] = field(init=False)

    def __post_init__(self) -> None:
        self._chunk_exclude = set(self._never_on_chunks)
        if not self.include_usage:
            self._chunk_exclude.add("usage")

    def event(self, chunk: ChatCompletionChunk | Completion) -> bytes:
        """One SSE ``data:`` event of ``chunk``."""
        return encode_data(dump(chunk, self._chunk_exclude))

    def usage_event(self, usage: Usage) -> bytes:
        """The last event of a stream with ``include_usage``: no choices, the usage."""
        return encode_data(dump(self.usage_chunk(usage), set(self._never_on_chunks)))

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk | Completion:
        """The stream's usage chunk: no choices, the usage."""
        return self._chunk_type(
            id=self.rid, created=self.created, model=self.model, choices=[], usage=usage
        )

    def chunk(self, i: int, d: StepOutput, offset: int) -> ChatCompletionChunk | Completion | None:
        raise NotImplementedError

    def chunks(self, i: int, d: StepOutput, offset: int) -> list[ChatCompletionChunk | Completion]:
        """The chunks of choice ``i``'s new output (none, one, or several: a chat answer with
        tools may add content and tool-call fragments at once)."""
        c = self.chunk(i, d, offset)
        return [] if c is None else [c]

    def body(self, outputs: list[CompletionOutput], usage: Usage) -> ChatCompletion | Completion:
        raise NotImplementedError

    def json(self, outputs: list[CompletionOutput], usage: Usage) -> bytes:
        """The whole non-streaming body as JSON bytes."""
        return dump(self.body(outputs, usage))

    def closing(self, outputs: list[CompletionOutput], usage: Usage) -> list[bytes]:
        """The events that end a stream: the usage chunk (with ``include_usage``), ``[DONE]``."""
        events = [self.usage_event(usage)] if self.include_usage else []
        return [*events, DONE]

    def error_event(self, err: APIError) -> bytes:
        """The in-band error event of a stream cut short (``data: {"error": {...}}``)."""
        return encode_event(err.body())


class ChatRenderer(_Renderer):
    """``chat.completion`` bodies and ``chat.completion.chunk`` streams.

    With a ``tools`` plan (``tools.ToolPlan``, not ``"none"``) each choice's answer is split
    into content and ``tool_calls`` (finish reason ``"tool_calls"`` when it ended with calls).
    """

    route = "chat"
    _chunk_type = ChatCompletionChunk
    __slots__ = ("tools", "_tool_deltas")

    def __init__(self, *args: Any, tools: ToolPlan | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tools = tools if tools is not None and tools.active else None
        self._tool_deltas: dict[int, ToolDeltas] = {}

    def chunks(self, i: int, d: StepOutput, offset: int) -> list[ChatCompletionChunk | Completion]:
        if self.tools is None:
            return super().chunks(i, d, offset)
        td = self._tool_deltas.setdefault(i, ToolDeltas(self.tools))
        deltas = td.feed(d.delta_text) if d.delta_text else []
        finish: str | None = d.finish_reason
        if finish is not None:
            deltas += td.finish()
            if td.called and finish == "stop":
                finish = "tool_calls"
        logprobs = self._logprobs(d.logprobs) if d.logprobs else None
        if not deltas and (logprobs is not None or finish is not None):
            deltas = [{}]
        out: list[ChatCompletionChunk | Completion] = []
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            choice = ChatChunkChoice(
                index=i,
                delta=ChoiceDelta.model_validate(delta),
                logprobs=logprobs if k == 0 else None,
                finish_reason=finish if last else None,
            )
            out.append(self._chunk(choice))
        return out

    def opening(self, n: int) -> list[ChatCompletionChunk]:
        """The chunks opening a stream: each choice's role."""
        return [
            self._chunk(ChatChunkChoice(index=i, delta=ChoiceDelta(role="assistant", content="")))
            for i in range(n)
        ]

    def chunk(self, i: int, d: StepOutput, offset: int) -> ChatCompletionChunk | None:
        """The chunk of choice ``i``'s new output (None when nothing visible is new: a
        held-back stop-string prefix or partial UTF-8). ``offset``: unused for chat."""
        logprobs = self._logprobs(d.logprobs) if d.logprobs else None
        finish = d.finish_reason
        if not d.delta_text and logprobs is None and finish is None:
            return None
        delta = (
            ChoiceDelta(content=d.delta_text) if d.delta_text or finish is None else ChoiceDelta()
        )
        return self._chunk(
            ChatChunkChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=finish)
        )

    def body(self, outputs: list[CompletionOutput], usage: Usage) -> ChatCompletion:
        """The whole ``chat.completion`` of finished choices."""
        return ChatCompletion(
            id=self.rid,
            created=self.created,
            model=self.model,
            choices=[self._choice(i, o) for i, o in enumerate(outputs)],
            usage=usage,
        )

    def _choice(self, i: int, o: CompletionOutput) -> ChatChoice:
        logprobs = self._logprobs(o.logprobs or [])
        if self.tools is None:
            message = AssistantMessage(content=o.text)
            return ChatChoice(
                index=i, message=message, logprobs=logprobs, finish_reason=o.finish_reason
            )
        content, calls = parse_output(self.tools, o.text)
        finish = tool_finish_reason(self.tools, o.text, calls, o.finish_reason)
        message = AssistantMessage(
            content=content,
            tool_calls=[ToolCall.model_validate(c.as_openai()) for c in calls] or None,
        )
        return ChatChoice(index=i, message=message, logprobs=logprobs, finish_reason=finish)

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.rid, created=self.created, model=self.model, choices=[choice]
        )

    def _logprobs(self, entries: list[TokenLogprobs]) -> ChatLogprobs | None:
        if self.num_logprobs is None:
            return None
        return chat_logprobs(self.token_text, entries)


class CompletionRenderer(_Renderer):
    """``text_completion`` bodies and streams (chunks have no ``system_fingerprint``)."""

    route = "completions"
    _chunk_type = Completion
    __slots__ = ()
    _never_on_chunks = frozenset({"system_fingerprint"})

    def opening(self, n: int) -> list[Completion]:
        """Nothing opens a completions stream."""
        return []

    def chunk(self, i: int, d: StepOutput, offset: int) -> Completion | None:
        """The chunk of choice ``i``'s new output (None when nothing visible is new);
        ``offset``: characters of the choice's text before it (for ``text_offset``)."""
        logprobs = self._logprobs(d.logprobs, offset) if d.logprobs else None
        if not d.delta_text and logprobs is None and d.finish_reason is None:
            return None
        choice = CompletionChoice(
            index=i, text=d.delta_text, logprobs=logprobs, finish_reason=d.finish_reason
        )
        return Completion(id=self.rid, created=self.created, model=self.model, choices=[choice])

    def body(self, outputs: list[CompletionOutput], usage: Usage) -> Completion:
        """The whole ``text_completion`` of finished choices."""
        return Completion(
            id=self.rid,
            created=self.created,
            model=self.model,
            choices=[
                CompletionChoice(
                    index=i,
                    text=o.text,
                    logprobs=self._logprobs(o.logprobs or []),
                    finish_reason=o.finish_reason,
                )
                for i, o in enumerate(outputs)
            ],
            usage=usage,
        )

    def _logprobs(self, entries: list[TokenLogprobs], offset: int = 0) -> CompletionLogprobs | None:
        if self.num_logprobs is None:
            return None
        return completion_logprobs(self.token_text, entries, offset)


class Renderer(Protocol):
    """What ``Exchange`` asks of a route's renderer (chat, completions, responses)."""

    @property
    def route(self) -> str: ...

    @property
    def include_usage(self) -> bool: ...

    def opening(self, n: int) -> Sequence[Any]: ...

    def chunks(self, i: int, d: StepOutput, offset: int) -> Sequence[Any]: ...

    def event(self, chunk: Any) -> bytes: ...

    def json(self, outputs: list[CompletionOutput], usage: Usage) -> bytes: ...

    def closing(self, outputs: list[CompletionOutput], usage: Usage) -> list[bytes]: ...

    def error_event(self, err: APIError) -> bytes: ...
