"""Run many calls under the client's limits; results in input order, errors per item."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import anyio

__all__ = ["run_batch"]

T = TypeVar("T")


async def run_batch(
    call: Callable[..., Awaitable[T]],
    requests: Sequence[Mapping[str, Any]],
    *,
    workers: int,
    progress: bool = False,
    desc: str = "requests",
) -> list[T | Exception]:
    """Await ``call(**request)`` for every request, ``workers`` at a time.

    One failing item never cancels the others: its slot in the result holds the exception
    (``asyncio.gather(return_exceptions=True)`` convention). Cancelling the batch cancels all.

    Args:
        call: the resource method (``client.chat.completions.create``).
        requests: keyword arguments of each call.
        workers: tasks pulling requests (the client's ``max_concurrency``: its limiter is what
            bounds requests in flight; more tasks would only wait on it).
        progress: show a tqdm progress bar (on stderr).
        desc: the progress bar's label.

    Raises:
        TypeError: an item of ``requests`` is not a mapping (before anything is sent).
    """
    items = list(requests)
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise TypeError(f"batch request {i} must be a mapping of create() arguments")
    results: list[Any] = [None] * len(items)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(items), desc=desc, unit="req")
    next_index = iter(range(len(items)))

    async def worker() -> None:
        for i in next_index:
            try:
                results[i] = await call(**items[i])
            except Exception as exc:  # per-item error: recorded, never propagated
                results[i] = exc
            if bar is not None:
                bar.update(1)

    try:
        async with anyio.create_task_group() as tg:
            for _ in range(max(1, min(workers, len(items)))):
                tg.start_soon(worker)
    finally:
        if bar is not None:
            bar.close()
    return results
