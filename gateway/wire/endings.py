"""An answer its engine aborted (``finish_reason: "abort"``, vLLM's, as prefixgate's engine
reports it) in the dialects that translate a chat: Anthropic's Messages, Gemini's
``generateContent`` and OpenAI's Responses, in local mode and through a proxy alike.

Chat and completions pass the finish reason on as vLLM does (the client reads it). The
translating dialects have no word for it: Messages' ``stop_reason`` would say ``end_turn``,
Gemini's ``finishReason`` ``OTHER``, Responses ``completed`` — a success for an answer cut
short. So an aborted answer is an error there (``aborted_error``): a whole answer is the
dialect's error object with this status; a stream ends with the dialect's error ending (an
Anthropic ``error`` event; Gemini's error chunk; Responses' ``error`` event then
``response.failed``), as any stream cut short does.
"""

from __future__ import annotations

from typing import Any

from prefixgate.gateway.http.errors import APIError

ABORT = "abort"
"""The finish reason of an aborted request (vLLM's)."""


def is_aborted(finish: Any) -> bool:
    """Whether ``finish`` (an OpenAI ``finish_reason``) says the request was aborted."""
    return finish == ABORT


def aborted_error(upstream: bool) -> APIError:
    """The error of an answer aborted before it finished: 502 when the proxy's upstream
    aborted it (``upstream``), else 500 (the local engine did); code ``request_aborted``."""
    who = "the upstream" if upstream else "the engine"
    return APIError(
        502 if upstream else 500,
        f'{who} aborted the request before it finished (finish_reason "abort"); the '
        "answer is cut short",
        code="request_aborted",
    )
