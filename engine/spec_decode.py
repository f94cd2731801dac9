"""Speculative decoding by n-gram prompt lookup (vLLM's ``ngram`` method) and its verification.

**Drafts** (``NgramProposer``): for a running request whose tokens are ``x[0..L)`` (prompt +
output), the longest suffix ``x[L-n..L)`` with ``prompt_lookup_min <= n <= prompt_lookup_max``
that also occurs earlier in ``x`` is looked up (longest ``n`` first; among its earlier
occurrences the most recent one), and the ``k`` tokens that followed that occurrence are the
drafts (where they run past the end, the text is continued with the period of the match: a
loop drafts ``k`` tokens of itself). No match, no drafts: the request decodes as usual that step (no extra cost but the
lookup). This is prompt lookup decoding (Saxena 2023), vLLM's ``NgramProposer``.

**Verification** (``ModelRunner`` + ``Sampler.verify``): the request's query in the step's one
batched forward is ``[x[L-1], d_1 .. d_k]`` at positions ``L-1 .. L-1+k``; the logits at all
``k + 1`` positions are computed and the logits pipeline runs position by position, each
position seeing the output so far plus the drafts accepted before it (so penalties,
``logit_bias``, ``min_tokens``, ``bad_words``, ``allowed_token_ids`` hold at every accepted
token). Greedy: draft ``d_j`` is accepted while it is the argmax; the first mismatch position
gives the argmax instead (the correction) and, when all ``k`` are accepted, the last position
gives one more (the bonus token): output identical to decoding one token at a time.
Random sampling: ``rejection_sample`` below, which keeps the output distribution exactly the
target's.

Requests that speculation skips (they decode one token a step): those with a structured-output
grammar (the matcher would have to roll back rejected drafts), those asking for ``logprobs``
(one ``TokenLogprobs`` per step is what the runner reports), and those whose acceptance stayed
low (``SpecDecodeState``: an exponentially weighted mean of accepted / drafted per verify step
under ``min_acceptance`` turns speculation off for the request for a cool-down of output tokens
that doubles each time, so a request whose answer does not repeat its input pays a verify step
only now and then).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and numpy only where used: the scheduler imports this module
    import torch  # torch-free
    from prefixgate.engine.request import Request, RequestStatus


SPEC_METHODS = ("ngram",)
"""The ``speculative_method`` values ``EngineConfig`` takes (``None``: off)."""

ACCEPTANCE_ALPHA = 0.3
"""Weight of the newest verify step in a request's acceptance mean."""

MIN_VERIFY_STEPS = 3
"""Verify steps before a request's acceptance mean may turn its speculation off."""

COOLDOWN_TOKENS = 16
"""Output tokens without speculation after its first turn-off (doubles each time)."""


class NgramProposer:
    """Proposes draft tokens by n-gram lookup in the request's own tokens.

    Args:
        num_speculative_tokens: most drafts per step (``k``), >= 1.
        prompt_lookup_min: shortest n-gram matched, >= 1.
        prompt_lookup_max: longest n-gram matched, >= ``prompt_lookup_min``.

    Raises:
        ValueError: bounds out of range.
    """

    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{prompt_lookup_min} and {prompt_lookup_max}"
            )
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(
        self,
        token_ids: Sequence[int],
        max_drafts: int | None = None,
        index: NgramIndex | None = None,
        min_n: int | None = None,
    ) -> list[int]:
        """Draft tokens to follow ``token_ids`` (``[L]`` ints): up to ``min(k, max_drafts)``
        ids, ``[]`` when no n-gram of the allowed lengths recurs (or ``max_drafts <= 0``).

        ``index``: the request's ``NgramIndex`` (kept across steps: each call then costs
        O(new tokens x n-gram lengths) dict operations, not a scan of all L tokens); without
        one, a scan with numpy (O(L x n) per tried n). Both give the same drafts.
        ``min_n``: the shortest n-gram matched this time (a request's adaptive bound,
        ``SpecDecodeState.min_n``), clamped to ``prompt_lookup_min .. prompt_lookup_max``.
        """
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        lo = self.min_n if min_n is None else min(max(min_n, self.min_n), self.max_n)
        n_tokens = len(token_ids)
        if k <= 0 or n_tokens < lo + 1:
            return []
        if index is not None:
            index.extend(token_ids)
            for n in range(min(self.max_n, n_tokens - 1), lo - 1, -1):
                end = index.ends[n - self.min_n].get(tuple(token_ids[n_tokens - n :]))
                if end is not None:
                    return _continue(token_ids, end, k)
            return []
        import numpy as np

        x = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, n_tokens - 1), lo - 1, -1):
            suffix = x[n_tokens - n :]
            # windows starting at 0 .. L-n-1: every occurrence that ends before the suffix's end
            windows = np.lib.stride_tricks.sliding_window_view(x[: n_tokens - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                return _continue(token_ids, int(hits[-1]) + n, k)
        return []

    def new_index(self) -> NgramIndex:
        """An empty ``NgramIndex`` for this proposer's n-gram lengths."""
        return NgramIndex(self.min_n, self.max_n)


def _continue(token_ids: Sequence[int], end: int, k: int) -> list[int]:
    """The ``k`` tokens that follow position ``end`` when the text goes on as it did there:
    ``x[end:]``, and past the last token the drafts themselves (a match ``p`` tokens back
    repeats with period ``p``: a loop "a b a b" drafts "a b a b", not just "a")."""
    n_tokens = len(token_ids)
    out = list(token_ids[end : min(end + k, n_tokens)])
    while len(out) < k:
        out.append(out[len(out) - (n_tokens - end)])
    return out


class NgramIndex:
    """Per request: for each n-gram length ``n``, n-gram → the end (exclusive) of its latest
    occurrence that is followed by a token, over the tokens seen so far (tokens only ever
    append, so the index grows with them; a preempted request keeps its tokens and index).

    Args:
        min_n, max_n: the n-gram lengths indexed.
    """

    __slots__ = ("ends", "max_n", "min_n", "upto")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        self.upto = 0  # n-grams ending at 1 .. upto are indexed

    def extend(self, token_ids: Sequence[int]) -> None:
        """Index the n-grams ending at ``upto + 1 .. L - 1`` of ``token_ids`` (``[L]``, the
        same request's tokens, longer than or as long as last time)."""
        last = len(token_ids) - 1  # an n-gram ending at L is the suffix: not indexed
        for end in range(self.upto + 1, last + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.ends[n - self.min_n][tuple(token_ids[end - n : end])] = end
        self.upto = max(self.upto, last)


@dataclass(slots=True)
class SpecDecodeState:
    """One request's speculation bookkeeping (``Request.spec``).

    The draft policy adapts per request: the number of drafts of the next verify step
    (``num_drafts``) grows by 2 after a step whose drafts were all accepted and shrinks by 1
    after one with a rejection (Hugging Face's assisted generation "heuristic" schedule), so a
    request whose drafts miss pays for one draft row a step, not ``k``; the shortest n-gram
    matched (``min_n``) grows by 1 after a step that accepted nothing (a longer match is
    likelier to continue the same way) and falls back by 1 after a fully accepted one.

    Attributes:
        acceptance: exponentially weighted mean of accepted / drafted per verify step
            (``None`` before the first).
        num_verify_steps: verify steps so far.
        resume_at: output-token count before which no drafts are proposed (0: now).
        cooldown: output tokens of the next turn-off.
        index: the request's ``NgramIndex`` (the scheduler's proposer fills it).
        num_drafts: most drafts of the next verify step (``None``: the proposer's ``k``).
        min_n: shortest n-gram of the next lookup (``None``: the proposer's minimum).
    """

    acceptance: float | None = None
    num_verify_steps: int = 0
    resume_at: int = 0
    cooldown: int = COOLDOWN_TOKENS
    index: NgramIndex | None = None
    num_drafts: int | None = None
    min_n: int | None = None

    def enabled(self, num_output_tokens: int) -> bool:
        """True when drafts may be proposed at this output length."""
        return num_output_tokens >= self.resume_at

    def record(
        self,
        num_drafts: int,
        num_accepted: int,
        num_output_tokens: int,
        min_acceptance: float,
        max_drafts: int | None = None,
        ngram_bounds: tuple[int, int] | None = None,
    ) -> None:
        """Fold one verify step (``num_accepted`` of ``num_drafts`` drafts accepted) into the
        mean; under ``min_acceptance`` (after ``MIN_VERIFY_STEPS``) speculation pauses for
        ``cooldown`` output tokens, and the next pause is twice as long. With ``max_drafts``
        (the proposer's ``k``) the next step's ``num_drafts`` adapts, with ``ngram_bounds``
        (its ``(min, max)`` n-gram) its ``min_n`` (see the class docstring)."""
        if max_drafts is not None:
            grown = num_drafts + 2 if num_accepted == num_drafts else num_drafts - 1
            self.num_drafts = min(max(grown, 1), max_drafts)
        if ngram_bounds is not None:
            lo, hi = ngram_bounds
            cur = lo if self.min_n is None else self.min_n
            if num_accepted == 0:
                cur += 1
            elif num_accepted == num_drafts:
                cur -= 1
            self.min_n = min(max(cur, lo), hi)
        rate = num_accepted / num_drafts
        a = self.acceptance
        self.acceptance = (
            rate if a is None else (1 - ACCEPTANCE_ALPHA) * a + ACCEPTANCE_ALPHA * rate
        )
        self.num_verify_steps += 1
        if self.num_verify_steps >= MIN_VERIFY_STEPS and self.acceptance < min_acceptance:
            self.resume_at = num_output_tokens + self.cooldown
            self.cooldown *= 2
            self.acceptance = None
            self.num_verify_steps = 0


class SpecDecoding:
    """The scheduler's side of speculative decoding: a decode's drafts (``propose``), a verify
    step's accepted run appended to its request (``accept``), and vLLM's ``spec_decode_*``
    counters (``stats``).

    Args:
        proposer: the drafter.
        min_acceptance: ``EngineConfig.spec_min_acceptance`` (``SpecDecodeState.record``).
    """

    def __init__(self, proposer: NgramProposer, min_acceptance: float) -> None:
        self.proposer = proposer
        self.min_acceptance = float(min_acceptance)
        self.num_drafts = 0  # verify steps (vLLM's spec_decode_num_drafts)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def propose(
        self, req: Request, room: int, max_model_len: int, cap: int | None = None
    ) -> list[int]:
        """Draft tokens for a decode of ``req`` (``[]``: plain decode): none for a grammar,
        logprobs or a pin request, while its speculation pauses, or beyond ``room`` budget
        tokens, ``cap`` (its tenant's tokens left this round, less the decode's own),
        ``max_tokens`` or ``max_model_len``."""
        if room <= 0:
            return []
        params = req.sampling_params
        if req.structured_output is not None or req.pin_job is not None:
            return []
        if params is not None and params.logprobs is not None:
            return []
        if req.spec is None:
            req.spec = SpecDecodeState()
        if not req.spec.enabled(req.num_output_tokens):
            return []
        limit = min(
            room,
            req.max_tokens - req.num_output_tokens - 1,  # accepted + bonus within max_tokens
            max_model_len - req.num_tokens - 1,
        )
        if cap is not None:
            limit = min(limit, cap)
        if req.spec.num_drafts is not None:  # the request's adaptive draft count
            limit = min(limit, req.spec.num_drafts)
        if limit <= 0:
            return []
        if req.spec.index is None:
            req.spec.index = self.proposer.new_index()
        return self.proposer.propose(req.all_token_ids, limit, req.spec.index, min_n=req.spec.min_n)

    def accept(
        self,
        req: Request,
        tokens: int | Sequence[int],
        num_drafts: int,
        now: float,
        max_model_len: int,
        on_token: Callable[[Request], None],
    ) -> tuple[int, RequestStatus | None]:
        """Append one verify step's run to ``req``: ``tokens`` are the accepted drafts (of
        ``num_drafts``) then the correction / bonus token. Each is appended, handed to
        ``on_token`` and checked (``Request.check_stop``) in turn; the first that ends the
        request ends the run. Counts the step and folds it into ``req.spec``. Returns
        ``(accepted drafts kept, finished status or None)``: the KV is valid through the last
        accepted draft kept."""
        run = [tokens] if isinstance(tokens, int) else list(tokens)
        accepted = len(run) - 1
        status = None
        appended = 0
        for token in run:
            req.append_output_token(token, now)
            appended += 1
            on_token(req)
            status = req.check_stop(max_model_len)
            if status is not None:
                break
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        if req.spec is not None:
            p = self.proposer
            req.spec.record(
                num_drafts,
                accepted,
                req.num_output_tokens,
                self.min_acceptance,
                max_drafts=p.k,
                ngram_bounds=(p.min_n, p.max_n),
            )
        return min(accepted, appended), status

    def stats(self) -> dict[str, Any]:
        """vLLM's ``spec_decode_*`` counters: verify steps, draft tokens proposed, drafts
        accepted, and their ratio (``None`` before any draft)."""
        n = self.num_draft_tokens
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": n,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_acceptance_rate": self.num_accepted_tokens / n if n else None,
        }


def rejection_sample(
    probs: torch.Tensor, draft_token_id: int, u_accept: float, u_residual: float
) -> tuple[int, bool]:
    """Verify one draft token against the target distribution ``probs``; returns
    ``(token id, accepted)``.

    Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
    Speculative Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model
    Decoding with Speculative Sampling", Algorithm 2) accepts a draft ``t`` drawn from ``q``
    with probability ``min(1, p(t) / q(t))`` and on rejection samples from
    ``norm(max(0, p - q))``. An n-gram drafter's ``q`` is a point mass on ``t`` (``q(t) = 1``),
    so: accept ``t`` with probability ``p(t)``; on rejection draw from ``p`` with ``t``
    removed, renormalised (``max(0, p - q)`` is ``p`` off ``t`` and 0 at ``t``). The output is
    distributed exactly as ``p``: ``P(t) = p(t)``, ``P(x != t) = (1 - p(t)) p(x) / (1 - p(t))``.

    Args:
        probs: ``[V]`` float target probabilities (after temperature, top-k/p, min-p; need
            not sum exactly to 1).
        draft_token_id: the draft ``t``.
        u_accept, u_residual: two independent uniforms in ``[0, 1)``.

    Raises:
        ValueError: ``probs`` not 1-D, or ``draft_token_id`` outside ``[0, V)``.
    """
    import torch

    if probs.dim() != 1:
        raise ValueError(f"probs must be [V], got {tuple(probs.shape)}")
    if not 0 <= draft_token_id < probs.shape[0]:
        raise ValueError(f"draft token {draft_token_id} outside the vocabulary of {probs.shape[0]}")
    total = float(probs.sum())
    p_t = float(probs[draft_token_id]) / total if total > 0 else 0.0
    if u_accept < p_t:
        return draft_token_id, True
    residual = probs.clone()
    residual[draft_token_id] = 0
    cdf = residual.cumsum(0)
    if float(cdf[-1]) <= 0:  # p was a point mass on t (rounding put u above it): keep t
        return draft_token_id, True
    target = u_residual * float(cdf[-1])
    picked = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True))
    last = int(torch.nonzero(residual > 0)[-1, 0])
    return min(picked, last), False
