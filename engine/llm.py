"""LLM: offline batched generation in vLLM's shape (``LLM(model).generate(prompts, params)``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from prefixgate.engine.config import EngineConfig
from prefixgate.engine.front_end import EngineFrontEnd
from prefixgate.engine.llm_engine import LLMEngine
from prefixgate.engine.outputs import CompletionOutput, RequestOutput
from prefixgate.engine.protocol import EngineRequest, PinRequest
from prefixgate.engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]
Message = dict[str, Any]


class LLM(EngineFrontEnd):
    """Offline engine: give it prompts, get finished ``RequestOutput`` objects back (vLLM's
    shape: ``outputs[0].text``).

    Args:
        model: Hugging Face model directory, or ``None`` for the built-in ``tiny-random`` preset.
        **engine_args: any other ``EngineConfig`` field (``block_size``, ``num_kv_blocks``,
            ``enable_prefix_caching``, ``load_format``, ...).

    Raises:
        TypeError: an unknown engine argument. ValueError / FileNotFoundError: bad config.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._counter = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
        tenant: str | Sequence[str | None] | None = None,
        priority: int | Sequence[int] = 0,
    ) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching), outputs in input order: each a
        finished ``RequestOutput`` whose ``outputs[0]`` holds the prompt's whole text, token ids
        and logprobs, accumulated once from its step outputs.

        Args:
            prompts: one string, a list of strings, one list of token ids, or a list of them.
            sampling_params: one ``SamplingParams`` for all, or one per prompt; ``None`` = defaults.
            cache_salt: prefix-cache partition for all these requests.
            tenant: who the ``fair`` scheduling policy charges: one for all, or one per prompt.
            priority: one ``priority`` for all, or one per prompt (vLLM's ``priority``: lower
                first, read by the ``priority`` scheduling policy).

        Raises:
            TypeError / ValueError: bad prompt or params; nothing is queued then (all prompts are
                validated before the first is added).
        """
        plist = _normalize_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(plist)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(plist):
                raise ValueError(f"got {len(params_list)} sampling params for {len(plist)} prompts")
        prios = [priority] * len(plist) if isinstance(priority, int) else list(priority)
        tenants = (
            [tenant] * len(plist) if tenant is None or isinstance(tenant, str) else list(tenant)
        )
        if len(prios) != len(plist) or len(tenants) != len(plist):
            raise ValueError(
                f"got {len(prios)} priorities and {len(tenants)} tenants for {len(plist)} prompts"
            )
        first = next(self._counter)
        prepared = [
            self.engine.prepare_request(
                EngineRequest(f"llm-{first + k}", p, sp or SamplingParams(), cache_salt, t, pr)
            )
            for k, (p, sp, t, pr) in enumerate(zip(plist, params_list, tenants, prios, strict=True))
        ]
        self._counter = itertools.count(first + len(prepared))  # ids taken only when all pass
        results = {req.request_id: CompletionOutput(req.request_id) for req in prepared}
        added: list[str] = []
        try:
            for req in prepared:
                self.engine.add_request(req)
                added.append(req.request_id)
            self._run(results)
            return [
                RequestOutput(
                    req.request_id,
                    req.prompt,
                    list(req.prompt_token_ids),
                    [out],
                    num_cached_tokens=out.num_cached_tokens,
                    metrics=out.metrics,
                )
                for req, out in zip(prepared, results.values(), strict=True)
            ]
        except BaseException:
            for rid in added:
                try:
                    self.engine.abort_request(rid)
                except ValueError:
                    pass  # already finished
            raise

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (a list of
        ``{"role", "content"}`` dicts) or a list of conversations, then ``generate``.

        The rendered template carries its own special tokens (e.g. ``{{ bos_token }}``), so it is
        tokenized without adding more (as ``transformers``' ``apply_chat_template`` does);
        special-token strings inside message contents stay plain text (``encode_chat``).

        Raises:
            ValueError: malformed messages (from the template); see ``generate``.
        """
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of conversations")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts: list[list[int]] = []
        for conv in convs:
            prompts.append(
                self.tokenizer.encode_chat(list(conv), add_generation_prompt=add_generation_prompt)
            )
        return self.generate(prompts, sampling_params, cache_salt=cache_salt)

    def pin_prefix(
        self,
        token_ids: Sequence[int] | str,
        ttl_s: float,
        cache_salt: str | None = None,
        tenant: str | None = None,
    ) -> Any:
        """Compute and pin a prefix (token ids, or text tokenized with special tokens) for
        ``ttl_s`` seconds, charged to ``tenant``; returns a ``PrefixPin``. See
        ``LLMEngine.pin_prefix``."""
        ids = self.tokenizer.encode(token_ids) if isinstance(token_ids, str) else token_ids
        return self.engine.pin_prefix(PinRequest(ids, ttl_s, cache_salt, tenant))

    def unpin_prefix(self, pin_id: str) -> None:
        """Release a pin."""
        self.engine.unpin_prefix(pin_id)

    def stats(self) -> dict[str, Any]:
        """Engine counters (see ``LLMEngine.stats``)."""
        return self.engine.stats()

    def check_invariants(self) -> None:
        """Raise AssertionError on broken KV block bookkeeping."""
        self.engine.check_invariants()

    def _run(self, results: dict[str, CompletionOutput]) -> None:
        """Step the engine until every request of ``results`` finished, adding each output
        to its request's accumulator."""
        left = set(results)
        while left:
            if not self.engine.has_unfinished_requests():
                missing = [rid for rid in results if rid in left]
                raise RuntimeError(f"engine went idle with requests unfinished: {missing}")
            for out in self.engine.step():
                acc = results.get(out.request_id)
                if acc is not None:
                    acc.add(out)
                    if out.finished:
                        left.discard(out.request_id)
            failed = [(rid, exc) for rid, exc in self.engine.pop_failed() if rid in results]
            if failed:
                raise failed[0][1]  # the caller's other requests are aborted by generate()


def _normalize_prompts(prompts: Any) -> list[Prompt]:
    """One prompt or a list of prompts → list of prompts (str or list[int])."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes | bytearray):
        raise TypeError(
            f"prompts must be a string, a list of strings or token-id lists, got {type(prompts).__name__}"
        )
    if not prompts:
        return []
    first = prompts[0]
    if isinstance(first, int) and not isinstance(first, bool):
        return [list(prompts)]
    return list(prompts)
