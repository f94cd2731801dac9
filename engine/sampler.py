"""Next-token sampling for a batch: the logits pipeline, greedy / random choice, logprobs.

Every change to a row's logits before the choice (grammar mask, ``allowed_token_ids``,
``bad_words``, ``min_tokens``, ``logit_bias``, repetition / frequency / presence penalties) is a step of the one ordered pipeline,
``prefixgate.engine.logits_processors.LogitsPipeline`` (its docstring holds the order and the
conflict rules). Then: greedy argmax, or temperature → top-k → top-p → min-p → one draw.
Logprobs are the ``log_softmax`` of the model logits after the grammar mask, before every
other step (vLLM's; without a grammar, the raw model logits).

Random draws use inverse-CDF sampling with exactly one uniform number per request per step,
taken from the request's own ``torch.Generator`` (or, for requests without a seed, from the
sampler's engine-level generator), so a seeded request samples the same tokens whatever else
shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from prefixgate.engine.logits_processors import (
    STEP_ORDER,
    LogitsPipeline,
    SamplingState,
)
from prefixgate.engine.outputs import Logprob, TokenLogprobs
from prefixgate.engine.sampling_params import SamplingParams
from prefixgate.engine.spec_decode import rejection_sample

__all__ = ["STEP_ORDER", "SampleResult", "Sampler", "SamplingState", "apply_penalties"]

GREEDY_EPS = 1e-5  # temperatures below this are greedy (dividing by them overflows fp32)
ARGMAX_BLOCK = 1024  # columns a block of greedy_argmax's first pass


@dataclass(slots=True)
class SampleResult:
    """The chosen token and, when asked for, its logprob plus the top-n alternatives."""

    token_id: int
    logprobs: TokenLogprobs | None = None


class Sampler:
    """Samples one token per row of a logits batch.

    Args:
        seed: seed of the shared generator used by requests without their own seed.
        pipeline: the logits pipeline (``LogitsPipeline(structured_output)``); the default has
            no structured output (a row with a grammar then raises ValueError).
    """

    def __init__(self, seed: int = 0, pipeline: LogitsPipeline | None = None) -> None:
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.pipeline = pipeline if pipeline is not None else LogitsPipeline()

    def sample(self, logits: torch.Tensor, batch: Sequence[SamplingState]) -> list[SampleResult]:
        """Pick the next token of every request.

        Args:
            logits: ``[B, V]`` float32 raw model logits, row i for ``batch[i]``; not modified.
            batch: B sampling states.

        Returns:
            B results in batch order.

        Raises:
            ValueError: ``logits`` is not 2-D or its row count differs from ``len(batch)``.
        """
        if logits.dim() != 2 or logits.shape[0] != len(batch):
            raise ValueError(
                f"logits must be [B, V] with B == len(batch) == {len(batch)}, "
                f"got {tuple(logits.shape)}"
            )
        if not batch:
            return []
        params = [s.sampling_params for s in batch]
        processed = self.pipeline(logits, batch)
        random_rows = [i for i, p in enumerate(params) if p.temperature >= GREEDY_EPS]
        wants_logprobs = any(p.logprobs is not None for p in params)
        scores = processed.scores
        if not random_rows and not wants_logprobs:
            return [SampleResult(t) for t in greedy_argmax(scores).tolist()]  # all greedy

        scores = scores.float()
        if len(random_rows) == len(batch):
            tokens = torch.empty(len(batch), dtype=torch.int64, device=logits.device)
        else:
            tokens = greedy_argmax(scores)
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            picked = self._sample_random(scores[rows], [batch[i] for i in random_rows])
            tokens[rows] = picked
        token_list = tokens.tolist()
        lps = (
            _logprobs(processed.logprob_logits, params, token_list)
            if wants_logprobs
            else [None] * len(batch)
        )
        return [SampleResult(t, lp) for t, lp in zip(token_list, lps, strict=True)]

    def _sample_random(self, scores: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """``scores [R, V]`` (penalized logits) → ``[R]`` int64 sampled ids."""
        probs = self._probs(scores, states)
        # Generators may live on different devices (per-request CUDA ones, the shared CPU one).
        uniforms = torch.cat([self._uniform(s.generator).cpu() for s in states]).to(probs.device)
        return inverse_cdf(probs, uniforms)

    @staticmethod
    def _probs(scores: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """``scores [R, V]`` float32 (penalized logits) → ``[R, V]`` the distributions drawn
        from: temperature, top-k, top-p, softmax, min-p."""
        params = [s.sampling_params for s in states]
        device = scores.device
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        scores = scores / temps.unsqueeze(1)
        scores = apply_top_k(scores, [p.top_k for p in params])
        scores = apply_top_p(scores, [p.top_p for p in params])
        probs = torch.softmax(scores, dim=-1)
        return apply_min_p(probs, [p.min_p for p in params])

    def verify(
        self, logits: torch.Tensor, state: SamplingState, draft_token_ids: Sequence[int]
    ) -> list[int]:
        """Verify ``k`` draft tokens of one request (speculative decoding).

        Row ``j`` of ``logits`` is the model's prediction after the request's tokens plus
        drafts ``d_1..d_j``. Position by position, the logits pipeline runs with the output so
        far plus the drafts accepted before it, then: greedy accepts ``d_{j+1}`` while it is
        the argmax; random sampling accepts it by ``spec_decode.rejection_sample`` (output
        distribution unchanged). The first rejection yields the replacement token; when all
        are accepted, the last row yields one more (the bonus).

        Args:
            logits: ``[k + 1, V]`` float32 raw model logits.
            state: the request's sampling state (no grammar: the scheduler drafts none there).
            draft_token_ids: the ``k`` drafts.

        Returns:
            The accepted drafts then the replacement / bonus token: 1 to ``k + 1`` ids.

        Raises:
            ValueError: ``logits`` not ``[k + 1, V]``, or ``state`` has a grammar.
        """
        k = len(draft_token_ids)
        if logits.dim() != 2 or logits.shape[0] != k + 1:
            raise ValueError(
                f"logits must be [{k + 1}, V] for {k} drafts, got {tuple(logits.shape)}"
            )
        if state.structured_output is not None:
            raise ValueError("speculative verification does not take a structured-output grammar")
        drafts = [int(d) for d in draft_token_ids]
        outputs = list(state.output_token_ids)
        greedy = state.sampling_params.temperature < GREEDY_EPS
        states = [  # the request as it would stand at each draft position
            SamplingState(
                state.sampling_params,
                state.prompt_token_ids,
                outputs + drafts[:j],
                state.generator,
                state.eos_token_ids,
            )
            for j in range(k + 1)
        ]
        steps = self.pipeline.steps
        if greedy and not any(step.applies(st) for st in states for step in steps):
            targets = greedy_argmax(logits).tolist()  # the pipeline would change nothing
            out: list[int] = []
            for j in range(k + 1):
                out.append(int(targets[j]))
                if j == k or targets[j] != drafts[j]:
                    return out
            return out
        out = []
        for j in range(k + 1):
            st = states[j]
            scores = self.pipeline(logits[j : j + 1], [st]).scores.float()
            if greedy:
                t = int(scores[0].argmax())
                out.append(t)
                if j == k or t != drafts[j]:
                    return out
                continue
            probs = self._probs(scores, [st])
            if j == k:  # the bonus token: a plain draw
                out.append(int(inverse_cdf(probs, self._uniform(st.generator).cpu())[0]))
                return out
            u1 = float(self._uniform(st.generator))
            u2 = float(self._uniform(st.generator))
            t, accepted = rejection_sample(probs[0], drafts[j], u1, u2)
            out.append(t)
            if not accepted:
                return out
        return out

    def _uniform(self, generator: torch.Generator | None) -> torch.Tensor:
        gen = generator if generator is not None else self.generator
        return torch.rand(1, generator=gen, device=gen.device)


def greedy_argmax(scores: torch.Tensor) -> torch.Tensor:
    """``scores.argmax(dim=-1)`` of a ``[B, V]`` tensor, the same indices (the first of equal
    maxima; a row's first NaN where it has one), in two passes on the CPU: each row's maximum
    per block of :data:`ARGMAX_BLOCK` columns (``amax``, which runs on every intra-op thread
    and vectorized), then ``argmax`` over the block maxima and within the block that won
    (torch's CPU ``argmax`` over a long row is far slower than ``amax``: docs/cpu-performance.md).
    Other devices, rows of under two blocks, non-contiguous scores: ``argmax`` itself.

    Returns:
        ``[B]`` int64.
    """
    rows, vocab = scores.shape
    blocks = vocab // ARGMAX_BLOCK
    if scores.device.type != "cpu" or blocks < 2 or not scores.is_contiguous():
        return scores.argmax(dim=-1)
    whole = blocks * ARGMAX_BLOCK
    maxima = scores[:, :whole].view(rows, blocks, ARGMAX_BLOCK).amax(dim=-1)
    if whole < vocab:  # the last columns, a shorter block of their own
        maxima = torch.cat([maxima, scores[:, whole:].amax(dim=-1, keepdim=True)], dim=1)
    start = maxima.argmax(dim=-1) * ARGMAX_BLOCK  # [B] the first block holding the maximum
    # the winning block of each row (past the last column: the last column again, which
    # cannot come before the first maximum)
    cols = (start.unsqueeze(1) + torch.arange(ARGMAX_BLOCK)).clamp_(max=vocab - 1)
    return start + scores.gather(1, cols).argmax(dim=-1)


def apply_penalties(row: torch.Tensor, state: SamplingState) -> None:
    """Run the pipeline's steps after the grammar (``allowed_token_ids``, ``bad_words``,
    ``min_tokens``, ``logit_bias``, repetition, frequency / presence) on one ``[V]`` float32 logits row, in place (tests and tools; the
    sampler runs the whole ``LogitsPipeline`` on its batch).
    """
    batch = row.unsqueeze(0)
    for step in LogitsPipeline().steps[1:]:
        if step.applies(state):
            step.apply(batch, [0], [state])


def apply_top_k(scores: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """Keep each row's ``k`` highest scores (ties at the k-th value kept); ``k <= 0`` or
    ``k >= V`` keeps all. ``scores [R, V]`` → ``[R, V]`` with the rest at ``-inf``."""
    vocab = scores.shape[1]
    ks = [k if 0 < k < vocab else vocab for k in top_ks]
    if all(k == vocab for k in ks):
        return scores
    top = scores.topk(max(k for k in ks if k < vocab), dim=-1).values
    k_idx = torch.tensor([min(k, top.shape[1]) - 1 for k in ks], device=scores.device)
    threshold = top.gather(1, k_idx.unsqueeze(1))
    active = torch.tensor([k < vocab for k in ks], device=scores.device).unsqueeze(1)
    return scores.masked_fill(active & (scores < threshold), float("-inf"))


def apply_top_p(scores: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Nucleus filter (Holtzman et al. 2019): keep the smallest set of most likely tokens
    whose probability mass reaches ``top_p`` (the most likely token always kept).
    Rows with ``top_p == 1`` are untouched. ``scores [R, V]`` → ``[R, V]``."""
    rows = [i for i, p in enumerate(top_ps) if p < 1.0]
    if not rows:
        return scores
    idx = torch.tensor(rows, device=scores.device)
    sub = scores[idx]
    sorted_scores, order = sub.sort(dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_scores, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    ps = torch.tensor([top_ps[i] for i in rows], device=scores.device).unsqueeze(1)
    drop_sorted = mass_before >= ps
    drop_sorted[:, 0] = False  # the most likely token always stays (a tiny top_p may be 0.0 here)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    scores = scores.clone()
    scores[idx] = sub.masked_fill(drop, float("-inf"))
    return scores


def apply_min_p(probs: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's top probability
    (Nguyen et al. 2024, "min-p sampling"). ``probs [R, V]`` → renormalized ``[R, V]``."""
    if not any(m > 0 for m in min_ps):
        return probs
    mins = torch.tensor(min_ps, dtype=probs.dtype, device=probs.device).unsqueeze(1)
    keep = probs >= mins * probs.max(dim=-1, keepdim=True).values
    probs = probs * keep
    return probs / probs.sum(dim=-1, keepdim=True)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Sample one id per row: the first index whose cumulative probability exceeds ``u``
    times the row total. Zero-probability tokens are never chosen.

    Args:
        probs: ``[R, V]`` non-negative (need not sum exactly to 1).
        uniforms: ``[R]`` in [0, 1).

    Returns:
        ``[R]`` int64 ids.
    """
    cdf = probs.cumsum(dim=-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # Rounding can put the target at the total: fall back to the last token with mass.
    vocab = probs.shape[1]
    last_nonzero = vocab - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
    return torch.minimum(picked, last_nonzero)


def _logprobs(
    logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]
) -> list[TokenLogprobs | None]:
    """Per row: the sampled token's logprob and the top-n, from the raw logits. Alternatives
    at -inf (tokens a grammar masked: they could not have been sampled) are left out, so a
    row may list fewer than n; sent as they were, they became ``"logprob": null`` on the
    wire, which OpenAI's schema (and the proxy's check of it) refuses."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    idx = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits[idx].float(), dim=-1)
    chosen = lp.gather(1, torch.tensor([tokens[i] for i in rows], device=lp.device).unsqueeze(1))
    n_max = max(params[i].logprobs or 0 for i in rows)
    top_vals, top_ids = lp.topk(n_max, dim=-1) if n_max else (lp[:, :0], lp[:, :0].long())
    chosen_l, top_v, top_i = chosen.squeeze(1).tolist(), top_vals.tolist(), top_ids.tolist()
    out: list[TokenLogprobs | None] = [None] * len(params)
    for j, i in enumerate(rows):
        n = params[i].logprobs
        out[i] = TokenLogprobs(
            sampled=Logprob(tokens[i], chosen_l[j]),
            top=[
                Logprob(t, v)
                for t, v in zip(top_i[j][:n], top_v[j][:n], strict=True)
                if v != float("-inf")
            ],
        )
    return out
