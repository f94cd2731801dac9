"""Turns a request's step into its caller-facing ``StepOutput``: only what is new.

The ``Request`` holds the state (its ``IncrementalDetokenizer``, the text and logprobs since
its last output, how many tokens earlier outputs reported, its timestamps); this module
attaches the detokenizer at admission and builds each step's delta (vLLM's
``RequestOutputKind.DELTA``). Nothing here copies a request's whole token ids, logprobs or
text: whoever needs them whole accumulates the deltas once (``outputs.CompletionOutput``).
"""

from __future__ import annotations

from typing import Any

from prefixgate.engine.outputs import StepOutput, TokenLogprobs
from prefixgate.engine.request import Request, RequestStatus


class OutputProcessor:
    """Detokenizer set-up, decoded logprobs and ``StepOutput`` building (no state of its own).

    Args:
        tokenizer: the engine's tokenizer (``decode`` for logprob tokens).
        detokenizer_cls: ``IncrementalDetokenizer`` (``(tokenizer, prompt_ids, params)``).
    """

    def __init__(self, tokenizer: Any, detokenizer_cls: Any) -> None:
        self.tokenizer = tokenizer
        self.detokenizer_cls = detokenizer_cls

    def attach(self, req: Request) -> None:
        """Give a caller request its detokenizer (primed with the prompt) and, when it asked
        for logprobs, its list of logprobs since the last output."""
        params = req.sampling_params
        req.detokenizer = self.detokenizer_cls(self.tokenizer, req.prompt_token_ids, params)
        req.new_logprobs = [] if params is not None and params.logprobs is not None else None

    def add_logprobs(self, req: Request, logprobs: TokenLogprobs | None) -> None:
        """Record the logprobs of the request's newest token (``decoded`` filled in)."""
        if req.new_logprobs is not None and logprobs is not None:
            req.new_logprobs.append(self._with_decoded(logprobs))

    def make_output(self, req: Request) -> StepOutput:
        """The ``StepOutput`` of what the request produced since the previous call. A
        finished request (other than aborted or ended by a stop string) first gets the text
        its detokenizer held back."""
        finished = req.is_finished()
        detok = req.detokenizer
        if (
            finished
            and detok is not None
            and req.status != RequestStatus.FINISHED_ABORTED
            and detok.stop_string is None
        ):
            req.new_text += detok.finish() or ""
        n_sent = req.num_sent_tokens
        new_ids = req.output_token_ids[n_sent:]
        req.num_sent_tokens += len(new_ids)
        text, req.new_text = req.new_text, ""
        logprobs = req.new_logprobs
        if logprobs is not None:
            req.new_logprobs = []
        first_tokens = n_sent == 0 and bool(new_ids)
        return StepOutput(
            request_id=req.request_id,
            delta_token_ids=new_ids,
            delta_text=text,
            logprobs=logprobs,
            finish_reason=req.finish_reason if finished else None,  # type: ignore[arg-type]
            stop_reason=req.stop_reason if finished else None,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            metrics=req.metrics if finished or first_tokens else {},
        )

    def _with_decoded(self, lp: TokenLogprobs) -> TokenLogprobs:
        for item in (lp.sampled, *lp.top):
            if not item.decoded:
                item.decoded = self.tokenizer.decode([item.token_id], skip_special_tokens=False)
        return lp
