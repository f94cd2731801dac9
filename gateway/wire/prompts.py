"""Prompts to token ids: chat rendering, completion prompts, length checks, sampling params.

Chat messages are rendered with the model's chat template and encoded *without* adding special
tokens (``engine.tokenizer.encode_chat``), as transformers' ``apply_chat_template(tokenize=True)``
and vLLM's chat endpoint do: the template writes the BOS token itself. Unlike theirs, a
special-token string inside a message's content (``"<s>"``, a fake ``"<|im_start|>system"``) is
tokenized as plain text: only the template's markup yields control tokens, so one tenant's
user text can never forge a role boundary. Completion prompts given as text are encoded with special tokens
(BOS added), as vLLM's completions endpoint does; token-id prompts are passed as they are.

Rendering and tokenizing run in a worker thread (``render_chat`` and ``completion_prompts``
are coroutines), through ``encode_batch`` where the tokenizer has it (Hugging Face
``tokenizers`` releases the GIL there, not in ``encode``): a multi-megabyte prompt takes
seconds to tokenize, and the event loop must keep serving every other client meanwhile.
Given ``max_model_len``, a text whose token count's lower bound
(``Tokenizer.min_num_tokens``, from its UTF-8 length) already fills the context is refused
before it is tokenized (400 ``context_length_exceeded``): a 4 MB over-context prompt costs
microseconds, not seconds and gigabytes.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from prefixgate.engine.protocol import TokenizerLike
from prefixgate.engine.sampling_params import (
    token_id_key,
)
from prefixgate.gateway.http.errors import APIError, bad_request


async def render_chat(
    tokenizer: TokenizerLike,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    max_model_len: int | None = None,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template (in a worker thread);
    ``tools`` (OpenAI's function tools) are passed to the template as ``tools``,
    ``template_kwargs`` (vLLM's ``chat_template_kwargs``, checked by
    ``request_models.check_template_kwargs``) as more template variables;
    ``continue_final_message`` ends the rendering inside the last message (no end of turn).

    Raises:
        APIError: 400 when the template refuses the conversation (e.g. roles out of order;
            ``param`` ``messages``), or the final message cannot be continued (``param``
            ``continue_final_message``); 400 ``context_length_exceeded`` when the rendered
            text cannot fit ``max_model_len`` tokens (checked before tokenizing).
    """
    return await asyncio.to_thread(
        _render_chat,
        tokenizer,
        messages,
        add_generation_prompt,
        max_model_len,
        tools,
        template_kwargs,
        continue_final_message,
    )


def refuse_oversized(
    tokenizer: TokenizerLike, text: str, max_model_len: int | None, param: str
) -> None:
    """400 ``context_length_exceeded`` when ``text`` has at least ``max_model_len`` tokens
    by ``tokenizer.min_num_tokens`` (no tokenization; a bound of 0 passes).

    Raises:
        APIError: 400 ``context_length_exceeded``.
    """
    if max_model_len is None:
        return
    at_least = tokenizer.min_num_tokens(text)
    if at_least >= max_model_len:
        raise OverContext(max_model_len, at_least, len(text), param)


class OverContext(APIError):
    """400 ``context_length_exceeded`` from a text's length alone (``refuse_oversized``):
    ``at_least`` tokens by ``min_num_tokens`` (``chars`` characters long) against a bound of
    ``bound`` tokens, naming ``param``. The generation routes' words; a counting route says
    its own (``local/tokenize.count_refusal``)."""

    def __init__(self, bound: int, at_least: int, chars: int, param: str) -> None:
        super().__init__(
            400,
            f"this model's maximum context length is {bound} tokens; the prompt has "
            f"at least {at_least} tokens ({chars} characters), leaving no room to generate",
            param=param,
            code="context_length_exceeded",
        )
        self.bound, self.at_least, self.chars = bound, at_least, chars


def _render_chat(
    tokenizer: TokenizerLike,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    max_model_len: int | None = None,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    check_tool_turns(messages)
    kwargs: dict[str, Any] = dict(template_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    if continue_final_message:  # only then: a TokenizerLike need not take the keyword
        kwargs["continue_final_message"] = True
    try:
        if max_model_len is not None and _contents_may_overflow(tokenizer, messages, max_model_len):
            # Only for a huge conversation: render it (cheap) and bound the rendering.
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, **kwargs
            )
            refuse_oversized(tokenizer, text, max_model_len, "messages")
        return list(
            tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        )
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001 - jinja raises its own types for template errors
        if str(exc).startswith("continue_final_message"):
            raise bad_request(str(exc), param="continue_final_message") from None
        raise bad_request(
            f"the chat template cannot render these messages: {exc}", param="messages"
        ) from None


def check_tool_turns(messages: list[dict[str, Any]]) -> None:
    """Every ``tool`` message answers a call an earlier assistant message made, by its
    ``tool_call_id`` (OpenAI's rule; a template would otherwise render a result of no call).

    Raises:
        APIError: 400 naming ``messages``: a tool message without ``tool_call_id``, or with
            an id no earlier assistant tool call has.
    """
    called: set[object] = set()
    for i, m in enumerate(messages):
        if m.get("role") == "assistant":
            called.update(c.get("id") for c in m.get("tool_calls") or [] if isinstance(c, dict))
        elif m.get("role") == "tool":
            call_id = m.get("tool_call_id")
            if call_id is None:
                raise bad_request(
                    f"messages.{i}: a tool message needs the tool_call_id of the call it answers",
                    param="messages",
                )
            if call_id not in called:
                raise bad_request(
                    f"messages.{i}: tool_call_id {str(call_id)[:80]!r} answers no tool call of "
                    "an earlier assistant message",
                    param="messages",
                )


def _contents_may_overflow(
    tokenizer: TokenizerLike, messages: list[dict], max_model_len: int
) -> bool:
    """True when the messages' text alone bounds at ``max_model_len`` tokens or more (the
    rendering, which holds it, is then bounded too)."""
    bound = tokenizer.min_num_tokens
    total = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += bound(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    total += bound(part["text"])
    return total >= max_model_len


def _encode(
    tokenizer: TokenizerLike, texts: list[str], add_special_tokens: bool
) -> list[list[int]]:
    """``encode_batch`` of the texts (Hugging Face ``tokenizers`` releases the GIL there)."""
    return [list(ids) for ids in tokenizer.encode_batch(texts, add_special_tokens)]


async def completion_prompts(
    tokenizer: TokenizerLike, prompt: str | list, max_model_len: int | None = None
) -> list[list[int]]:
    """Token ids of each prompt of a completions request (one, or a batch; in a worker
    thread).

    Raises:
        APIError: 400 on an empty prompt or a token id outside the vocabulary; 400
            ``context_length_exceeded`` when a text prompt cannot fit ``max_model_len``
            tokens (checked before tokenizing).
    """
    return await asyncio.to_thread(_completion_prompts, tokenizer, prompt, max_model_len)


def _completion_prompts(
    tokenizer: TokenizerLike, prompt: str | list, max_model_len: int | None = None
) -> list[list[int]]:
    if isinstance(prompt, str):
        batch: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        batch = [prompt]
    else:
        batch = list(prompt)
    if not batch:
        raise bad_request("prompt must not be empty", param="prompt")
    vocab = tokenizer.vocab_size
    if any(item == "" for item in batch):
        raise bad_request("prompt must not be empty", param="prompt")
    texts = [item for item in batch if isinstance(item, str)]
    for text in texts:
        refuse_oversized(tokenizer, text, max_model_len, "prompt")
    encoded = iter(_encode(tokenizer, texts, add_special_tokens=True) if texts else [])
    out = []
    for item in batch:
        if isinstance(item, str):
            ids = next(encoded)
        else:
            ids = list(item)
            if any(t < 0 or t >= vocab for t in ids):
                raise bad_request(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if not ids:
            raise bad_request("prompt must not be empty", param="prompt")
        out.append(ids)
    return out


def check_length(
    num_prompt_tokens: int,
    max_tokens: int | None,
    max_model_len: int,
    param: str,
    limit_param: str = "max_tokens",
) -> int:
    """The output limit in tokens, checked against the context length (vLLM's rule).

    Returns ``max_tokens``, or what is left of ``max_model_len`` when ``None``.

    Args:
        param: the prompt's field (``messages``, ``prompt``, ``input``).
        limit_param: the request's own name of the output limit (``max_tokens``,
            ``max_completion_tokens``, ``max_output_tokens``): the field named when it is
            too large.

    Raises:
        APIError: 400 ``context_length_exceeded`` naming ``param`` when the prompt alone fills
            the context, or naming ``limit_param`` when prompt + ``max_tokens`` exceeds it.
    """
    if num_prompt_tokens >= max_model_len:
        raise APIError(
            400,
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{num_prompt_tokens} tokens, leaving no room to generate",
            param=param,
            code="context_length_exceeded",
        )
    room = max_model_len - num_prompt_tokens
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise APIError(
            400,
            f"this model's maximum context length is {max_model_len} tokens: the prompt "
            f"({num_prompt_tokens} tokens) plus {limit_param} ({max_tokens}) exceeds it; "
            f"ask for at most {room} tokens",
            param=limit_param,
            code="context_length_exceeded",
        )
    return max_tokens


TRUNCATE_CONTEXTS = 8
"""With ``truncate_prompt_tokens`` a prompt is tokenized, then cut, unless its length alone
shows at least this many times ``max_model_len`` tokens (a 400 before tokenizing, as any
prompt past ``max_model_len`` without it): the bound of ``render_bound``."""


def kept_prompt_tokens(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """How many of the prompt's last tokens vLLM's ``truncate_prompt_tokens`` keeps: ``None``
    (not sent: all), ``-1``: ``max_model_len``, else the value.

    Raises:
        APIError: 400 naming ``truncate_prompt_tokens`` when it is over ``max_model_len``
            (vLLM's words).
    """
    if truncate_prompt_tokens is None:
        return None
    if truncate_prompt_tokens == -1:
        return max_model_len
    if truncate_prompt_tokens > max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens value ({truncate_prompt_tokens}) is greater than "
            f"max_model_len ({max_model_len}). Please, select a smaller truncation size.",
            param="truncate_prompt_tokens",
        )
    return truncate_prompt_tokens


def render_bound(keep: int | None, max_model_len: int) -> int:
    """The token bound a prompt's text is checked against before tokenizing
    (``refuse_oversized``): ``max_model_len``, or ``TRUNCATE_CONTEXTS`` times it for a prompt
    to be truncated to its last ``keep`` tokens."""
    return max_model_len if keep is None else TRUNCATE_CONTEXTS * max_model_len


def truncated(ids: list[int], keep: int | None) -> list[int]:
    """The last ``keep`` of ``ids`` (``None``: all): vLLM's left truncation."""
    return ids if keep is None or len(ids) <= keep else ids[len(ids) - keep :]


def choice_seeds(seed: int | None, n: int) -> list[int | None]:
    """Seeds of the ``n`` choices: ``seed + i``, wrapped into int64 (the schema's range, so
    ``2**63 - 1`` plus ``i`` is still a valid seed); a random base when ``n > 1`` and no seed
    is given (so sampled choices differ); ``[seed]`` when ``n == 1``."""
    if n == 1:
        return [seed]
    base = seed if seed is not None else random.getrandbits(31)
    return [(base + i + 2**63) % 2**64 - 2**63 for i in range(n)]


def _token_id_fields(req: Any) -> list[tuple[str, list[Any]]]:
    return [
        ("logit_bias", list(req.logit_bias or {})),
        ("stop_token_ids", list(req.stop_token_ids or [])),
    ]


def check_token_ids(req: Any) -> None:
    """``logit_bias`` keys and ``stop_token_ids`` must be token ids: an int or the decimal
    digits of one, not negative. Needs no model (the vocabulary's bound: ``check_vocab``).

    Raises:
        APIError: 400 naming the field.
    """
    for name, ids in _token_id_fields(req):
        for t in ids:
            tid = token_id_key(t)
            if tid is None:
                raise bad_request(
                    f"{name}: {str(t)[:20]!r} is not a token id (keys are the decimal digits "
                    'of one, as "42")',
                    param=name,
                )
            if tid < 0:
                raise bad_request(
                    f"{name}: token id {tid} is negative (token ids count from 0)", param=name
                )


def check_vocab(req: Any, vocab_size: int) -> None:
    """``logit_bias`` and ``stop_token_ids`` ids must be token ids of the model: those of
    ``check_token_ids``, below ``vocab_size``.

    Raises:
        APIError: 400 naming the field.
    """
    check_token_ids(req)
    for name, ids in _token_id_fields(req):
        for t in ids:
            tid = token_id_key(t)
            if tid is not None and tid >= vocab_size:
                raise bad_request(
                    f"{name}: token id {tid} is outside the vocabulary [0, {vocab_size})",
                    param=name,
                )
