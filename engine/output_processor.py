"""Turns sampled tokens into caller-facing ``RequestOutput`` deltas.

Per request it keeps an ``IncrementalDetokenizer`` (never broken UTF-8, stop strings held back
and cut), the cumulative text, the accumulated logprobs and the metrics timestamps; each step it
reports what is new (``delta_text`` / ``delta_token_ids``) next to the cumulative state, in the
shape of vLLM's ``RequestOutput`` with ``RequestOutputKind.DELTA`` folded into the same object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefixgate.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from prefixgate.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestState:
    """What the output processor remembers about one request.

    Attributes:
        request_id: the caller's id.
        prompt: prompt text when it was given as text, else ``None``.
        prompt_token_ids: the tokenized prompt.
        params: the request's sampling parameters.
        detokenizer: ``IncrementalDetokenizer`` for this request.
        text: cumulative text sent so far (stop strings excluded).
        num_sent_tokens: output tokens already reported in a previous output.
        num_sent_chars: characters of ``text`` already reported.
        logprobs: one ``TokenLogprobs`` per output token when ``params.logprobs`` is set.
        metrics: timestamps in seconds (``time.monotonic()``).
        stop_string: the stop string that ended the request, if any.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: Any
    text: str = ""
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    logprobs: list[TokenLogprobs] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    stop_string: str | None = None


class OutputProcessor:
    """Detokenizes new tokens and builds ``RequestOutput`` objects (cumulative + delta)."""

    def __init__(self, tokenizer: Any, detokenizer_cls: Any) -> None:
        self.tokenizer = tokenizer
        self.detokenizer_cls = detokenizer_cls
        self.states: dict[str, RequestState] = {}

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> None:
        """Start tracking a request (its detokenizer is primed with the prompt)."""
        detok = self.detokenizer_cls(self.tokenizer, prompt_token_ids, params)
        self.states[request_id] = RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            detokenizer=detok,
            logprobs=[] if params.logprobs is not None else None,
            metrics={"arrival": arrival_time},
        )

    def mark_scheduled(self, request_id: str, now: float) -> None:
        """Record the first time the request was scheduled."""
        state = self.states.get(request_id)
        if state is not None and "first_scheduled" not in state.metrics:
            state.metrics["first_scheduled"] = now

    def on_token(
        self,
        request_id: str,
        token_id: int,
        logprobs: TokenLogprobs | None,
        skip_text: bool,
        now: float,
    ) -> str | None:
        """Feed one sampled token; returns the stop string when the text now contains one.

        ``skip_text`` leaves the token out of the text (EOS or a stop token id that ends the
        request). After a stop string matched, later tokens add no text.
        """
        state = self.states[request_id]
        m = state.metrics
        m.setdefault("first_token", now)
        m["last_token"] = now
        if state.logprobs is not None and logprobs is not None:
            state.logprobs.append(self._with_decoded(logprobs))
        if skip_text or state.stop_string is not None:
            return None
        detok = state.detokenizer
        state.text += detok.step([token_id])
        stop = getattr(detok, "stop_string", None)
        if stop is not None:
            state.stop_string = stop
        return stop

    def make_output(
        self,
        request_id: str,
        output_token_ids: list[int],
        num_cached_tokens: int,
        finish_reason: str | None,
        stop_reason: str | int | None,
        now: float,
    ) -> RequestOutput:
        """Build the ``RequestOutput`` for the request's current state, with deltas since the
        previous call. When ``finish_reason`` is set, held-back text is flushed (unless a stop
        string ended the request), the state is dropped and ``finished`` is True."""
        state = self.states[request_id]
        if finish_reason is not None:
            if state.stop_string is not None:
                finish_reason, stop_reason = "stop", state.stop_string
            elif finish_reason != "abort":
                state.text += self._flush(state.detokenizer)
            state.metrics["finished"] = now
            del self.states[request_id]
        n_sent = state.num_sent_tokens
        delta_text = state.text[state.num_sent_chars :]
        state.num_sent_tokens = len(output_token_ids)
        state.num_sent_chars = len(state.text)
        completion = CompletionOutput(
            index=0,
            text=state.text,
            token_ids=list(output_token_ids),
            finish_reason=finish_reason,  # type: ignore[arg-type]
            stop_reason=stop_reason,
            logprobs=list(state.logprobs) if state.logprobs is not None else None,
            delta_text=delta_text,
            delta_token_ids=list(output_token_ids[n_sent:]),
        )
        return RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finish_reason is not None,
            num_cached_tokens=num_cached_tokens,
            metrics=dict(state.metrics),
        )

    def drop(self, request_id: str) -> None:
        """Forget a request without building an output (internal requests)."""
        self.states.pop(request_id, None)

    # -- helpers -------------------------------------------------------------------------

    @staticmethod
    def _flush(detok: Any) -> str:
        for name in ("finish", "flush"):
            fn = getattr(detok, name, None)
            if callable(fn):
                return fn() or ""
        return ""

    def _with_decoded(self, lp: TokenLogprobs) -> TokenLogprobs:
        for item in (lp.sampled, *lp.top):
            if not item.decoded:
                item.decoded = self.tokenizer.decode([item.token_id], skip_special_tokens=False)
        return lp
