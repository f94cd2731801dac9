"""Scheduling policies: which waiting request is admitted next, and which running one yields.

``EngineConfig.scheduling_policy``:

- ``"fcfs"``: first come first served (the waiting queue's order; preempted requests go back
  to its front); the preemption victim is the most recently admitted running request.
- ``"priority"``: as vLLM's ``priority`` policy — each request has an int ``priority``, lower
  runs first, ties by arrival time; the victim is the running request with the largest
  ``(priority, arrival_time)``.
- ``"fair"``: the Virtual Token Counter (VTC) of Sheng et al., "Fairness in Serving Large
  Language Models" (OSDI 2024). Each tenant has a counter of the service it received:
  ``(w_in * input tokens + w_out * output tokens) / weight(tenant)`` (input tokens charged at
  first admission, output tokens as they are sampled). The backlogged tenant (one with waiting
  requests) with the least counter is admitted next (its earliest request); a tenant that
  returns from idle has its counter lifted to the least counter of the backlogged tenants (or,
  when none is backlogged, to the current counter of the last tenant that left the queue), so idling
  earns no credit. Admission stays work-conserving (any tenant with a fitting request runs
  while capacity is left) and the service difference between two backlogged tenants stays
  within the paper's bound of ``2 * max(w_in * L_in + w_out * L_out)`` (Theorem 4.4). The
  victim is the running request of the tenant with the largest counter (latest admitted first).

Every policy keeps per-tenant statistics (served input / output tokens, queue lengths).
Requests without a tenant belong to tenant ``"default"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prefixgate.engine.request import Request

DEFAULT_TENANT = "default"


@dataclass(slots=True)
class TenantStats:
    """Service one tenant received (tokens) and its fair-share counter."""

    served_input_tokens: int = 0
    served_output_tokens: int = 0
    counter: float = 0.0


def tenant_of(req: Request) -> str:
    """The tenant a request is charged to (``"default"`` when it has none)."""
    return req.tenant or DEFAULT_TENANT


class SchedulingPolicy:
    """First come first served; the base of the other policies (tenant accounting included).

    Args:
        input_weight, output_weight: VTC's ``w_in`` / ``w_out`` (cost of one input / output
            token in the counters).
        tenant_weights: tenant → share weight (> 0; absent tenants weigh 1.0).
    """

    name = "fcfs"

    def __init__(
        self,
        input_weight: float = 1.0,
        output_weight: float = 2.0,
        tenant_weights: dict[str, float] | None = None,
    ) -> None:
        self.input_weight = float(input_weight)
        self.output_weight = float(output_weight)
        self.tenant_weights: dict[str, float] = dict(tenant_weights or {})
        self.tenants: dict[str, TenantStats] = {}

    # ---- accounting ---------------------------------------------------------------------
    def _stats(self, tenant: str) -> TenantStats:
        st = self.tenants.get(tenant)
        if st is None:
            st = self.tenants[tenant] = TenantStats()
        return st

    def weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, 1.0)

    def on_arrival(self, req: Request, waiting: Iterable[Request]) -> None:
        """A request joins the waiting queue (before it is appended)."""
        self._stats(tenant_of(req))

    def on_first_admission(self, req: Request, waiting: Sequence[Request]) -> None:
        """Charge the prompt when a request is admitted the first time (``waiting`` is the
        queue without it)."""
        t = tenant_of(req)
        st = self._stats(t)
        st.served_input_tokens += req.num_prompt_tokens
        st.counter += self.input_weight * req.num_prompt_tokens / self.weight(t)

    def on_output_token(self, req: Request) -> None:
        """Charge one sampled token."""
        t = tenant_of(req)
        st = self._stats(t)
        st.served_output_tokens += 1
        st.counter += self.output_weight / self.weight(t)

    # ---- decisions ----------------------------------------------------------------------
    def pick(self, waiting: Sequence[Request], skip: set[str]) -> Request | None:
        """The next waiting request to try to admit (``skip``: ids passed over this step)."""
        for req in waiting:
            if req.request_id not in skip:
                return req
        return None

    def victim(self, running: Sequence[Request]) -> Request:
        """The running request to preempt when the KV cache is out of blocks."""
        return running[-1]

    def tenant_stats(
        self, waiting: Iterable[Request], running: Iterable[Request]
    ) -> dict[str, dict[str, float | int]]:
        """Per tenant: served tokens, fair-share counter, waiting / running requests."""
        out: dict[str, dict[str, float | int]] = {
            t: {
                "served_input_tokens": st.served_input_tokens,
                "served_output_tokens": st.served_output_tokens,
                "virtual_counter": st.counter,
                "num_waiting": 0,
                "num_running": 0,
            }
            for t, st in self.tenants.items()
        }
        for key, reqs in (("num_waiting", waiting), ("num_running", running)):
            for r in reqs:
                row = out.get(tenant_of(r))
                if row is not None:
                    row[key] += 1
        return out


class PriorityPolicy(SchedulingPolicy):
    """Lower ``priority`` first, ties by arrival; victim: largest ``(priority, arrival)``."""

    name = "priority"

    def pick(self, waiting: Sequence[Request], skip: set[str]) -> Request | None:
        best: Request | None = None
        for req in waiting:
            if req.request_id in skip:
                continue
            if best is None or (req.priority, req.arrival_time) < (
                best.priority,
                best.arrival_time,
            ):
                best = req
        return best

    def victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=lambda r: (r.priority, r.arrival_time))


class FairPolicy(SchedulingPolicy):
    """Virtual Token Counter fair share across tenants (see the module docstring)."""

    name = "fair"

    def __init__(
        self,
        input_weight: float = 1.0,
        output_weight: float = 2.0,
        tenant_weights: dict[str, float] | None = None,
    ) -> None:
        super().__init__(input_weight, output_weight, tenant_weights)
        self._last_left: str | None = None  # the last tenant whose queue emptied

    def on_arrival(self, req: Request, waiting: Iterable[Request]) -> None:
        t = tenant_of(req)
        st = self._stats(t)
        backlogged = {tenant_of(r) for r in waiting}
        if t in backlogged:
            return
        if backlogged:  # lift to the least backlogged counter: idling earns no credit
            st.counter = max(st.counter, min(self._stats(b).counter for b in backlogged))
        elif self._last_left is not None:  # nobody waits: lift to the last one that did
            st.counter = max(st.counter, self._stats(self._last_left).counter)

    def on_first_admission(self, req: Request, waiting: Sequence[Request]) -> None:
        super().on_first_admission(req, waiting)
        t = tenant_of(req)
        if not any(tenant_of(r) == t for r in waiting):
            self._last_left = t

    def pick(self, waiting: Sequence[Request], skip: set[str]) -> Request | None:
        best: Request | None = None
        best_key: tuple[float, float] | None = None
        for req in waiting:
            if req.request_id in skip:
                continue
            key = (self._stats(tenant_of(req)).counter, req.arrival_time)
            if best_key is None or key < best_key:
                best, best_key = req, key
        return best

    def victim(self, running: Sequence[Request]) -> Request:
        i = max(
            range(len(running)),
            key=lambda i: (self._stats(tenant_of(running[i])).counter, i),
        )
        return running[i]


POLICIES: dict[str, type[SchedulingPolicy]] = {
    "fcfs": SchedulingPolicy,
    "priority": PriorityPolicy,
    "fair": FairPolicy,
}


def make_policy(
    name: str,
    input_weight: float = 1.0,
    output_weight: float = 2.0,
    tenant_weights: dict[str, float] | None = None,
) -> SchedulingPolicy:
    """The policy called ``name`` (``"fcfs"``, ``"priority"`` or ``"fair"``).

    Raises:
        ValueError: unknown name.
    """
    if name not in POLICIES:
        raise ValueError(f"scheduling_policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name](input_weight, output_weight, tenant_weights)
