"""The engine's one ordered logits pipeline: every step that changes a row's logits.

``LogitsPipeline(structured_output)(logits, states)`` is the only place a row's logits are
changed before the choice (temperature, top-k/p, min-p and the draw are the sampler's). Each
step is batched over the rows it applies to and runs in this declared order (``STEP_ORDER``):

1. ``grammar`` (hard mask, ``GrammarMask``): every token the row's structured-output grammar
   forbids gets ``-inf`` (xgrammar's token bitmask). **Ends follow the grammar**: EOS ids are
   the grammar's own stop tokens, so EOS is allowed exactly where the constrained text may end;
   the request's ``stop_token_ids`` are ends too, allowed (at their model logit) where the
   grammar may end and masked everywhere else, so a JSON answer never stops mid-object.
   Logprobs are read right after this step (as vLLM's: the model's logits with the grammar's
   mask, before every later step).
2. ``allowed_token_ids`` (``AllowedTokenIds``): every id not listed gets ``-inf``.
3. ``bad_words`` (``BadWords``): the last token of a bad word's token sequence gets ``-inf``
   where the output ends with the rest of it.
4. ``min_tokens`` (``MinTokens``): while fewer than ``min_tokens`` tokens were generated, EOS
   and ``stop_token_ids`` get ``-inf``.
5. ``logit_bias`` (``LogitBias``): each listed id's bias is added.
6. ``repetition_penalty`` (``RepetitionPenalty``): CTRL / HF formula over prompt + output.
7. ``frequency_presence`` (``FrequencyPresencePenalty``): OpenAI's formula over output tokens.

Conflict rules (each held by a test in ``tests/engine/test_logits_processors.py``):

- **No step leaves a row with no finite logit.** The grammar is the only hard mask and it
  wins every conflict: a ban of a later step (``allowed_token_ids``, ``bad_words``,
  ``min_tokens``, the stop-id ban of step 1) that would leave a row with nothing is lifted for
  that row and step (the earlier steps' bans stand: ``allowed_token_ids`` before ``bad_words``
  before ``min_tokens``). So when the grammar allows only
  end-of-sequence (its answer is complete), EOS stays allowed whatever ``min_tokens`` says and
  the request ends with ``"stop"`` before ``min_tokens`` (vLLM's rule); when the grammar's
  only tokens are stop ids where it cannot end (``{`` opening a JSON answer, say), they are
  its text: the grammar state's ``stop_ids_are_text`` is set for that step and
  ``Request.check_stop`` does not end the request on them.
  Steps 5-7 add or scale finite values, so they never create nor remove a ``-inf``.
- ``logit_bias`` cannot unmask a token the grammar, ``allowed_token_ids``, ``bad_words`` or
  ``min_tokens`` forbid (``-inf`` plus a finite bias is ``-inf``).
- Stop strings are not a logits step: like stop ids and EOS, they end a request only once
  ``min_tokens`` tokens were generated (``IncrementalDetokenizer`` ignores a stop string ending
  in the first ``min_tokens`` tokens' text; vLLM's semantics since 2025).
- A grammar that allows no token of the vocabulary at all (which a tokenizer missing the
  characters it needs can cause) leaves its row empty: the sampled token is then rejected by
  the grammar and the request fails with an explicit error (``Request.check_stop``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from prefixgate.engine.sampling_params import SamplingParams

NEG_INF = float("-inf")


@dataclass(slots=True)
class SamplingState:
    """What the logits pipeline and the sampler read of one request: the ``Request``'s own
    attributes of the same names (the model runner hands the ``Request`` itself); this
    dataclass holds them for a sampler used on its own (tests, benchmarks).

    Attributes:
        sampling_params: the request's sampling parameters.
        prompt_token_ids: prompt ids (repetition penalty).
        output_token_ids: ids generated so far (penalties, ``min_tokens``).
        generator: the request's own generator (seeded requests); ``None`` uses the
            sampler's shared generator.
        eos_token_ids: the model's EOS ids (banned, with stop token ids, until ``min_tokens``).
        structured_output: the request's ``StructuredOutputRequest`` (ready matcher) when its
            output is constrained, else ``None``.
    """

    sampling_params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None
    eos_token_ids: frozenset[int] | set[int] = frozenset()
    structured_output: Any | None = None


class LogitsStep(Protocol):
    """One step of the pipeline: ``applies`` picks its rows, ``apply`` changes them in place."""

    name: str

    def applies(self, state: SamplingState) -> bool:
        """True when this step changes the row of ``state``."""
        ...

    def apply(self, scores: torch.Tensor, rows: list[int], states: Sequence[SamplingState]) -> None:
        """Change ``scores[rows]`` (``[B, V]`` float32) in place; ``rows`` is never empty."""
        ...


def _pairs(
    rows: list[int], ids_of: list[list[int]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten per-row id lists into ``(row index [P], token id [P])`` int64 tensors, ids
    outside ``[0, vocab)`` dropped."""
    r: list[int] = []
    t: list[int] = []
    for row, ids in zip(rows, ids_of, strict=True):
        for tid in ids:
            if 0 <= tid < vocab:
                r.append(row)
                t.append(tid)
    return (
        torch.tensor(r, dtype=torch.int64, device=device),
        torch.tensor(t, dtype=torch.int64, device=device),
    )


def _unique_pairs(
    r: torch.Tensor, t: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct ``(row, token)`` pairs of ``r, t`` and how often each occurs:
    ``(rows [U], tokens [U], counts [U])`` int64."""
    keys, counts = torch.unique(r * vocab + t, return_counts=True)
    return keys // vocab, keys % vocab, counts


def _may_be_emptied(state: SamplingState, num_banned: int, vocab: int) -> bool:
    """Whether a ban of ``num_banned`` ids can leave this row without a finite logit: a row
    masked by a grammar or ``allowed_token_ids`` can; any other row holds the model's finite
    logits but for this call's other bans (bad words, ends), which are counted."""
    p = state.sampling_params
    if state.structured_output is not None or p.allowed_token_ids is not None:
        return True
    others = len(p.bad_words_token_ids) + len(state.eos_token_ids) + len(p.stop_token_ids)
    return num_banned + others >= vocab


def _ban_unless_empty(
    scores: torch.Tensor,
    r: torch.Tensor,
    t: torch.Tensor,
    states: Sequence[SamplingState],
    new: torch.Tensor | None = None,
) -> list[int]:
    """Set ``scores[r, t]`` to ``new`` (default ``-inf``), except in rows that would be left
    with no finite logit: those rows keep their values (the earlier steps win). Only rows
    that can be emptied (``_may_be_emptied``) are checked, so a plain row costs its pairs.

    Returns:
        The rows left as they were (sorted).
    """
    if r.numel() == 0:
        return []
    saved = scores[r, t].clone()
    scores[r, t] = NEG_INF if new is None else new
    per_row: dict[int, int] = {}
    for row in r.tolist():
        per_row[row] = per_row.get(row, 0) + 1
    vocab = scores.shape[1]
    check = [row for row, n in per_row.items() if _may_be_emptied(states[row], n, vocab)]
    if not check:
        return []
    rows = torch.tensor(sorted(check), dtype=torch.int64, device=scores.device)
    empty = scores[rows].amax(dim=-1) == NEG_INF
    if not bool(empty.any()):
        return []
    empty_rows = rows[empty]
    restore = torch.isin(r, empty_rows)
    scores[r[restore], t[restore]] = saved[restore]
    return empty_rows.tolist()


class GrammarMask:
    """Step 1: the structured-output grammar's mask, and ends (stop ids) that follow it.

    Args:
        structured_output: the engine's ``StructuredOutputManager`` (fills the bitmasks), or
            ``None`` for an engine without structured output (no row then has a grammar).
    """

    name = "grammar"

    def __init__(self, structured_output: Any | None) -> None:
        self.structured_output = structured_output

    def applies(self, state: SamplingState) -> bool:
        return state.structured_output is not None

    def apply(self, scores: torch.Tensor, rows: list[int], states: Sequence[SamplingState]) -> None:
        if self.structured_output is None:
            raise ValueError("a row has a grammar but the pipeline has no structured output")
        vocab, device = scores.shape[1], scores.device
        r, t = _pairs(
            rows, [list(states[i].sampling_params.stop_token_ids) for i in rows], vocab, device
        )
        before = scores[r, t].clone()
        grammars = [states[i].structured_output for i in rows]
        self.structured_output.apply_bitmask(scores, rows, grammars)
        for g in grammars:
            if g is not None:
                g.stop_ids_are_text = False
        if r.numel() == 0:
            return
        # A stop id is an end: allowed (at its model logit) where the grammar may end, that is
        # where it allows one of its stop tokens (the EOS ids); masked everywhere else.
        ends = sorted(
            {e for i in rows for e in states[i].eos_token_ids if 0 <= e < vocab}
            | {e for e in getattr(self.structured_output, "stop_token_ids", ()) if 0 <= e < vocab}
        )
        if ends:
            eos = torch.tensor(ends, dtype=torch.int64, device=device)
            can_end = torch.isfinite(scores[r.unsqueeze(1), eos.unsqueeze(0)]).any(dim=-1)
        else:
            can_end = torch.zeros(r.shape[0], dtype=torch.bool, device=device)
        new = torch.where(can_end, before, torch.full_like(before, NEG_INF))
        for i in _ban_unless_empty(scores, r, t, states, new):
            # the grammar's only tokens here are stop ids: the grammar wins, they are its text
            grammar = states[i].structured_output
            if grammar is not None:
                grammar.stop_ids_are_text = True


class AllowedTokenIds:
    """Step 2: ``allowed_token_ids``, every other id ``-inf`` (vLLM's), unless that leaves the
    row nothing (its grammar allows none of them: the grammar wins)."""

    name = "allowed_token_ids"

    def applies(self, state: SamplingState) -> bool:
        return state.sampling_params.allowed_token_ids is not None

    def apply(self, scores: torch.Tensor, rows: list[int], states: Sequence[SamplingState]) -> None:
        dev = scores.device
        local = list(range(len(rows)))
        ids = [list(states[i].sampling_params.allowed_token_ids or ()) for i in rows]
        r, t = _pairs(local, ids, scores.shape[1], dev)
        keep = torch.zeros(len(rows), scores.shape[1], dtype=torch.bool, device=dev)
        keep[r, t] = True
        idx = torch.tensor(rows, dtype=torch.int64, device=dev)
        sub = scores[idx]
        masked = sub.masked_fill(~keep, NEG_INF)
        empty = ~torch.isfinite(masked).any(dim=-1, keepdim=True)
        scores[idx] = torch.where(empty, sub, masked)


class BadWords:
    """Step 3: ``bad_words`` (vLLM's): for each token sequence of a bad word, its last token
    is banned when the output ends with the rest (a one-token word always), unless that
    leaves the row nothing."""

    name = "bad_words"

    def applies(self, state: SamplingState) -> bool:
        return bool(state.sampling_params.bad_words_token_ids)

    def apply(self, scores: torch.Tensor, rows: list[int], states: Sequence[SamplingState]) -> None:
        banned: list[list[int]] = []
        for i in rows:
            out = list(states[i].output_token_ids)
            ban = []
            for seq in states[i].sampling_params.bad_words_token_ids:
                head = seq[:-1]
                if not head or (len(out) >= len(head) and out[len(out) - len(head) :] == head):
                    ban.append(seq[-1])
            banned.append(ban)
        r, t = _pairs(rows, banned, scores.shape[1], scores.device)
        _ban_unless_empty(scores, r, t, states)


class MinTokens:
    """Step 4: EOS and stop token ids banned while fewer than ``min_tokens`` were generated
    (vLLM's ``MinTokensLogitsProcessor``), unless the grammar allows nothing else."""

    name = "min_tokens"

    def applies(self, state: SamplingState) -> bool:
        return len(state.output_token_ids) < state.sampling_params.min_tokens

    def apply(self, scores: torch.Tensor, rows: list[int], states: Sequence[SamplingState]) -> None:
        ends = [[*states[i].eos_token_ids, *states[i].sampling_params.stop_token_ids] for i in rows]
        r, t = _pairs(rows, ends, scores.shape[1], scores.device)
        _ban_unless_empty(scores, r, t, states)


class LogitBias:
    """Step 5: OpenAI's ``logit_bias``, each listed id's bias added to its logit."""

    name = "logit_bias"

    def applies(self, state: SamplingState) -> bool:
        return bool(state.sampling_params.logit_bias)

    def apply(self, scores: torch.Tensor, rows: list[int], states: Sequence[SamplingState]) -> None:
        vocab = scores.shape[1]
        r: list[int] = []
        t: list[int] = []
        v: list[float] = []
        for i in rows:
            for tid, bias in (states[i].sampling_params.logit_bias or {}).items():
                if 0 <= tid < vocab:
                    r.append(i)
                    t.append(tid)
                    v.append(bias)
        if not r:
            return
        dev = scores.device
        scores.index_put_(
            (torch.tensor(r, device=dev), torch.tensor(t, device=dev)),
            torch.tensor(v, dtype=scores.dtype, device=dev),
            accumulate=True,
        )


class RepetitionPenalty:
    """Step 6: CTRL's penalty (Keskar et al. 2019, HF's ``RepetitionPenaltyLogitsProcessor``):
    every token seen in prompt or output becomes ``l / r`` when ``l > 0`` else ``l * r``."""

    name = "repetition_penalty"

    def applies(self, state: SamplingState) -> bool:
        return state.sampling_params.repetition_penalty != 1.0

    def apply(self, scores: torch.Tensor, rows: list[int], states: Sequence[SamplingState]) -> None:
        # only the seen (row, token) pairs are read and written, each once
        vocab, dev = scores.shape[1], scores.device
        seen_ids = [[*states[i].prompt_token_ids, *states[i].output_token_ids] for i in rows]
        r, t = _unique_pairs(*_pairs(rows, seen_ids, vocab, dev), vocab)[:2]
        if r.numel() == 0:
            return
        rp_of = torch.ones(scores.shape[0], dtype=scores.dtype, device=dev)
        rp_of[torch.tensor(rows, device=dev)] = torch.tensor(
            [states[i].sampling_params.repetition_penalty for i in rows],
            dtype=scores.dtype,
            device=dev,
        )
        rp = rp_of[r]
        vals = scores[r, t]
        scores[r, t] = torch.where(vals > 0, vals / rp, vals * rp)


class FrequencyPresencePenalty:
    """Step 7: OpenAI's ``l[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty``,
    ``c[j]`` the count of j among the output tokens."""

    name = "frequency_presence"

    def applies(self, state: SamplingState) -> bool:
        p = state.sampling_params
        return bool(p.frequency_penalty or p.presence_penalty) and len(state.output_token_ids) > 0

    def apply(self, scores: torch.Tensor, rows: list[int], states: Sequence[SamplingState]) -> None:
        # only the (row, token) pairs seen in the output are written (the others change by 0)
        vocab, dev = scores.shape[1], scores.device
        outputs = [list(states[i].output_token_ids) for i in rows]
        r, t, counts = _unique_pairs(*_pairs(rows, outputs, vocab, dev), vocab)
        if r.numel() == 0:
            return
        fp_of = torch.zeros(scores.shape[0], dtype=scores.dtype, device=dev)
        pp_of = torch.zeros(scores.shape[0], dtype=scores.dtype, device=dev)
        idx = torch.tensor(rows, device=dev)
        fp_of[idx] = torch.tensor(
            [states[i].sampling_params.frequency_penalty for i in rows],
            dtype=scores.dtype,
            device=dev,
        )
        pp_of[idx] = torch.tensor(
            [states[i].sampling_params.presence_penalty for i in rows],
            dtype=scores.dtype,
            device=dev,
        )
        c = counts.to(scores.dtype)
        scores[r, t] -= c * fp_of[r] + pp_of[r]


STEP_ORDER = (
    "grammar",
    "allowed_token_ids",
    "bad_words",
    "min_tokens",
    "logit_bias",
    "repetition_penalty",
    "frequency_presence",
)


@dataclass(slots=True)
class ProcessedLogits:
    """What the pipeline hands the sampler.

    Attributes:
        scores: ``[B, V]`` float32 logits after every step (a copy when any step applied, else
            the input itself).
        logprob_logits: ``[B, V]`` float32 logits the logprobs are taken from: after the
            grammar mask, before the other steps.
        changed: True when any step applied to any row (the sampler's all-greedy fast path
            may then still take the argmax of ``scores``).
    """

    scores: torch.Tensor
    logprob_logits: torch.Tensor
    changed: bool


class LogitsPipeline:
    """The ordered steps (``STEP_ORDER``), applied to a batch in one call.

    Args:
        structured_output: the engine's ``StructuredOutputManager`` or ``None``.
    """

    def __init__(self, structured_output: Any | None = None) -> None:
        self.steps: tuple[LogitsStep, ...] = (
            GrammarMask(structured_output),
            AllowedTokenIds(),
            BadWords(),
            MinTokens(),
            LogitBias(),
            RepetitionPenalty(),
            FrequencyPresencePenalty(),
        )
        assert tuple(s.name for s in self.steps) == STEP_ORDER

    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> ProcessedLogits:
        """Apply every step, in order, to the rows it applies to.

        Args:
            logits: ``[B, V]`` float32 model logits, row i for ``states[i]``; not modified.
            states: B sampling states.

        Returns:
            ``ProcessedLogits`` (scores, the logits of the logprobs, whether anything changed).
        """
        plan = [(step, [i for i, s in enumerate(states) if step.applies(s)]) for step in self.steps]
        if not any(rows for _, rows in plan):
            return ProcessedLogits(logits, logits, False)
        scores = logits.float().clone()
        logprob_logits = logits
        for k, (step, rows) in enumerate(plan):
            if rows:
                step.apply(scores, rows, states)
                if step.name == "grammar":  # logprobs: the model's logits under the mask
                    later = any(r for _, r in plan[k + 1 :])
                    logprob_logits = scores.clone() if later else scores
        return ProcessedLogits(scores, logprob_logits, True)
