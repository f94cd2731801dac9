"""Benchmark workload: S system prompts, each shared by many users, each user with one task.

The shape is the one system-prompt prefix caching exists for (a deployed app sends the same
long instruction with every request). Inputs:

* a system-prompts CSV with the columns ``act`` (a name) and ``prompt`` (the text), as the
  awesome-chatgpt-prompts ``prompts.csv``;
* a user-tasks JSONL, one object a line with ``instruction`` and optional
  ``instances[0].input``, as self-instruct's ``seed_tasks.jsonl``.

A small sample of both ships in ``prefixgate/sdk/bench/data`` (see its README for the
sources and licences); ``../shared/workloads`` holds the full files.
"""

from __future__ import annotations

import csv
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("prefixgate.bench")

DATA_DIR = Path(__file__).resolve().parent / "data"
SAMPLE_SYSTEM_PROMPTS = DATA_DIR / "system_prompts.csv"
SAMPLE_USER_TASKS = DATA_DIR / "user_tasks.jsonl"


@dataclass(slots=True, frozen=True)
class SystemPrompt:
    """One system prompt: ``name`` (the CSV's ``act``) and ``text`` (its ``prompt``)."""

    name: str
    text: str


@dataclass(slots=True, frozen=True)
class OutputLenDist:
    """Distribution of requested output lengths (``max_tokens``), in tokens.

    ``kind`` is ``"fixed"`` (``values = (L,)``), ``"uniform"`` (``values = (lo, hi)``, both
    inclusive) or ``"choice"`` (``values`` = the lengths to pick from, uniformly).
    """

    kind: str
    values: tuple[int, ...]

    def sample(self, rng: random.Random, n: int) -> list[int]:
        """``n`` output lengths drawn with ``rng`` (deterministic for a seeded ``rng``)."""
        if self.kind == "fixed":
            return [self.values[0]] * n
        if self.kind == "uniform":
            lo, hi = self.values
            return [rng.randint(lo, hi) for _ in range(n)]
        return [rng.choice(self.values) for _ in range(n)]


def parse_output_len_dist(spec: str) -> OutputLenDist:
    """Parse ``"L"``, ``"fixed:L"``, ``"uniform:LO:HI"`` or ``"choice:A,B,C"`` (tokens).

    Raises:
        ValueError: an unknown form, a non-integer or a length < 1, or ``lo > hi``.
    """
    text = spec.strip()
    kind, _, rest = text.partition(":")
    try:
        if not rest and kind.isdigit():
            values: tuple[int, ...] = (int(kind),)
            kind = "fixed"
        elif kind == "fixed":
            values = (int(rest),)
        elif kind == "uniform":
            lo, hi = rest.split(":")
            values = (int(lo), int(hi))
            if values[0] > values[1]:
                raise ValueError(f"uniform output length needs lo <= hi, got {spec!r}")
        elif kind == "choice":
            values = tuple(int(v) for v in rest.split(",") if v.strip())
            if not values:
                raise ValueError(f"choice output length needs at least one value, got {spec!r}")
        else:
            raise ValueError(
                f"output length distribution must be L, fixed:L, uniform:LO:HI or choice:A,B,..., got {spec!r}"
            )
    except ValueError as exc:
        if "output length" in str(exc):
            raise
        raise ValueError(f"bad output length distribution {spec!r}: {exc}") from None
    if min(values) < 1:
        raise ValueError(f"output lengths must be >= 1 token, got {spec!r}")
    return OutputLenDist(kind, values)


@dataclass(slots=True)
class WorkloadConfig:
    """Knobs of a generated workload.

    Attributes:
        num_requests: requests to build.
        num_system_prompts: S, the distinct system prompts; request i uses prompt ``i % S``,
            so each is shared by about ``num_requests / S`` users. 0 sends no system prompt.
        system_prompt_min_chars: only system prompts at least this long (characters) are
            drawn; longer prompts raise the share of prompt tokens that are shared.
        system_prompt_max_chars: only system prompts at most this long; ``None``: no bound.
        user_task_max_chars: only user tasks at most this long (characters); ``None``: all.
        output_len: requested output lengths (``max_tokens``).
        seed: seed of every random choice (prompts, tasks, output lengths, arrivals).
    """

    num_requests: int = 64
    num_system_prompts: int = 1
    system_prompt_min_chars: int = 0
    system_prompt_max_chars: int | None = None
    user_task_max_chars: int | None = None
    output_len: OutputLenDist = field(default_factory=lambda: OutputLenDist("fixed", (64,)))
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.num_system_prompts < 0:
            raise ValueError(f"num_system_prompts must be >= 0, got {self.num_system_prompts}")


@dataclass(slots=True)
class BenchRequest:
    """One request of a workload.

    Attributes:
        index: position in the workload (0-based).
        messages: OpenAI chat messages (an optional ``system`` message, then one ``user``).
        max_tokens: requested output length in tokens.
        system_prompt: index of the system prompt among the S chosen, or -1 for none.
    """

    index: int
    messages: list[dict[str, str]]
    max_tokens: int
    system_prompt: int = -1


def load_system_prompts(path: str | Path) -> list[SystemPrompt]:
    """Read a CSV with ``act`` and ``prompt`` columns (UTF-8; rows with an empty prompt skipped).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the CSV lacks a ``prompt`` column or holds no prompt.
    """
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "prompt" not in reader.fieldnames:
            raise ValueError(f"{path}: a system-prompts CSV needs a 'prompt' column")
        prompts = [
            SystemPrompt(name=(row.get("act") or "").strip(), text=row["prompt"].strip())
            for row in reader
            if row.get("prompt") and row["prompt"].strip()
        ]
    if not prompts:
        raise ValueError(f"{path}: no system prompt found")
    return prompts


def task_text(obj: dict) -> str:
    """The user turn of a self-instruct task: ``instruction`` plus its first non-empty input."""
    text = str(obj.get("instruction", "")).strip()
    instances = obj.get("instances") or []
    extra = str(instances[0].get("input", "")).strip() if instances else ""
    return f"{text}\n\n{extra}" if extra else text


def load_user_tasks(path: str | Path) -> list[str]:
    """Read a JSONL of tasks (see :func:`task_text`); blank lines skipped.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not a JSON object with an ``instruction``, or no task.
    """
    tasks: list[str] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            if not isinstance(obj, dict) or not obj.get("instruction"):
                raise ValueError(f"{path}:{lineno}: a task needs an 'instruction'")
            tasks.append(task_text(obj))
    if not tasks:
        raise ValueError(f"{path}: no user task found")
    return tasks


def build_requests(
    system_prompts: list[SystemPrompt], user_tasks: list[str], config: WorkloadConfig
) -> list[BenchRequest]:
    """Pair S system prompts with user tasks into ``config.num_requests`` chat requests.

    The S prompts are drawn (seeded) from those of at least ``system_prompt_min_chars``; user
    tasks are shuffled (seeded) and reused in turn when there are fewer than requests.

    Raises:
        ValueError: fewer eligible system prompts than S, or no eligible user task.
    """
    rng = random.Random(config.seed)
    s = config.num_system_prompts
    chosen: list[SystemPrompt] = []
    if s:
        lo, hi = config.system_prompt_min_chars, config.system_prompt_max_chars
        eligible = [
            p for p in system_prompts if lo <= len(p.text) and (hi is None or len(p.text) <= hi)
        ]
        if len(eligible) < s:
            bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
            raise ValueError(
                f"{s} system prompts requested but only {len(eligible)} have {bound} characters"
            )
        chosen = rng.sample(eligible, s)
    limit = config.user_task_max_chars
    tasks = [t for t in user_tasks if limit is None or len(t) <= limit]
    if not tasks:
        raise ValueError(f"no user task has <= {limit} characters")
    rng.shuffle(tasks)
    if len(tasks) < config.num_requests:
        # Repeated user turns make whole prompts identical (fully cacheable): say so.
        logger.warning(
            "%d requests but only %d distinct user tasks: some prompts repeat whole",
            config.num_requests,
            len(tasks),
        )
    lengths = config.output_len.sample(rng, config.num_requests)
    requests = []
    for i in range(config.num_requests):
        messages = []
        sp = i % s if s else -1
        if s:
            messages.append({"role": "system", "content": chosen[sp].text})
        messages.append({"role": "user", "content": tasks[i % len(tasks)]})
        requests.append(BenchRequest(i, messages, lengths[i], sp))
    return requests


def load_workload(
    config: WorkloadConfig,
    system_prompts_path: str | Path | None = None,
    user_tasks_path: str | Path | None = None,
) -> list[BenchRequest]:
    """Build requests from the given files, or from the sample shipped with the package."""
    prompts = load_system_prompts(system_prompts_path or SAMPLE_SYSTEM_PROMPTS)
    tasks = load_user_tasks(user_tasks_path or SAMPLE_USER_TASKS)
    return build_requests(prompts, tasks, config)


def poisson_arrivals(rate: float, n: int, seed: int = 0) -> list[float]:
    """Send times (seconds after the start) of ``n`` requests arriving as a Poisson process.

    Gaps are exponential with mean ``1 / rate`` (the convention of vLLM's
    ``benchmark_serving``); the first request is sent at 0. ``rate = inf`` sends all at 0.

    Raises:
        ValueError: ``rate <= 0`` or ``n < 0``.
    """
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times
