"""What one scheduler step runs (``Scheduler.schedule()``'s result, read by the model runner):
``SchedulerOutput`` and each request's share of it, ``ScheduledRequest``. As vLLM v1's
``vllm/v1/core/sched/output.py``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixgate.engine.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request: the request (its ``num_computed_tokens`` is unchanged until
            ``update_from_output``).
        num_new_tokens: query tokens this step: ``all_token_ids[c : c + num_new_tokens]`` at
            positions ``c ..`` where ``c = num_computed_tokens``.
        block_ids: the request's whole block table after allocation (covers ``c + n`` tokens).
        num_computed_tokens: ``c``, the context already in the KV cache before this step.
        spec_token_ids: draft tokens verified this step (speculative decoding), the last
            ``len(spec_token_ids)`` of the ``num_new_tokens`` query tokens; ``[]`` otherwise.
    """

    request: Request
    num_new_tokens: int
    block_ids: list[int]
    num_computed_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this step reaches the request's last token: the runner samples it."""
        return (
            self.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids)
            == self.request.num_tokens
        )

    @property
    def is_decode(self) -> bool:
        """One query token (decode, or a one-token prefill tail treated the same way)."""
        return self.num_new_tokens == 1


@dataclass(slots=True)
class SchedulerOutput:
    """What one step runs.

    Attributes:
        scheduled: decodes first, then prefill chunks.
        num_scheduled_tokens: total query tokens (<= ``max_num_batched_tokens``).
        preempted: ids of requests preempted this step (the runner may drop their state).
        finished_ids: ids of requests that finished since the previous ``schedule()``
            (aborted, stopped by ``finish_requests`` or by ``update_from_output``).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
