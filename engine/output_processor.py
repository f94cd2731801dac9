"""Turns a request's state into caller-facing ``RequestOutput`` deltas.

The ``Request`` holds everything (its ``IncrementalDetokenizer``, the cumulative text, the
logprobs, what earlier outputs reported, its timestamps); this module only attaches the
detokenizer at admission and builds outputs in the shape of vLLM's ``RequestOutput`` with
``RequestOutputKind.DELTA`` folded into the same object (cumulative and new parts side by side).
"""

from __future__ import annotations

from typing import Any

from prefixgate.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from prefixgate.engine.request import Request, RequestStatus


class OutputProcessor:
    """Detokenizer set-up, decoded logprobs and ``RequestOutput`` building (no state of its own).

    Args:
        tokenizer: the engine's tokenizer (``decode`` for logprob tokens).
        detokenizer_cls: ``IncrementalDetokenizer`` (``(tokenizer, prompt_ids, params)``).
    """

    def __init__(self, tokenizer: Any, detokenizer_cls: Any) -> None:
        self.tokenizer = tokenizer
        self.detokenizer_cls = detokenizer_cls

    def attach(self, req: Request, prompt: str | None) -> None:
        """Give a caller request its detokenizer (primed with the prompt) and logprobs list."""
        params = req.sampling_params
        req.prompt = prompt
        req.detokenizer = self.detokenizer_cls(self.tokenizer, req.prompt_token_ids, params)
        req.logprobs = [] if params is not None and params.logprobs is not None else None

    def add_logprobs(self, req: Request, logprobs: TokenLogprobs | None) -> None:
        """Record the logprobs of the request's newest token (``decoded`` filled in)."""
        if req.logprobs is not None and logprobs is not None:
            req.logprobs.append(self._with_decoded(logprobs))

    def make_output(self, req: Request) -> RequestOutput:
        """The ``RequestOutput`` for the request's current state, with deltas since the previous
        call. A finished request (other than aborted or ended by a stop string) first gets the
        text its detokenizer held back."""
        finished = req.is_finished()
        detok = req.detokenizer
        if (
            finished
            and detok is not None
            and req.status != RequestStatus.FINISHED_ABORTED
            and detok.stop_string is None
        ):
            req.text += detok.finish() or ""
        out_ids = req.output_token_ids
        n_sent = req.num_sent_tokens
        delta_text = req.text[req.num_sent_chars :]
        req.num_sent_tokens = len(out_ids)
        req.num_sent_chars = len(req.text)
        completion = CompletionOutput(
            index=0,
            text=req.text,
            token_ids=list(out_ids),
            finish_reason=req.finish_reason if finished else None,  # type: ignore[arg-type]
            stop_reason=req.stop_reason if finished else None,
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            delta_text=delta_text,
            delta_token_ids=list(out_ids[n_sent:]),
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            metrics=req.metrics,
        )

    def _with_decoded(self, lp: TokenLogprobs) -> TokenLogprobs:
        for item in (lp.sampled, *lp.top):
            if not item.decoded:
                item.decoded = self.tokenizer.decode([item.token_id], skip_special_tokens=False)
        return lp
