"""Chat-template rendering: jinja2 templates in a sandboxed environment configured like
transformers' (``trim_blocks``, ``lstrip_blocks``, loop controls, ``raise_exception``,
``tojson``, ``strftime_now``), the shape check of chat messages, and where each message's
content lands in a rendering (``content_spans``, which ``Tokenizer.encode_chat`` uses to keep
special-token strings in user text plain). No tokenizer here: ``Tokenizer.apply_chat_template``
supplies the variables and encodes the text.
"""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["Message", "compile_template", "content_spans", "normalize_messages"]

Message = dict[str, Any]


def normalize_messages(messages: Any) -> list[Message]:
    """Check the shape of chat messages and flatten text-part lists into strings.

    Raises:
        TypeError: ``messages`` is not a list, or an item is not a dict.
        ValueError: an empty list, a message without a string ``role``, or content that is not
            a string, ``None`` or a list of text parts.
    """
    if not isinstance(messages, list | tuple):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    out: list[Message] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise TypeError(f"messages[{i}] must be a dict, got {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] needs a non-empty string 'role'")
        content = msg.get("content")
        if isinstance(content, list):
            content = "".join(_text_part(part, i) for part in content)
        elif content is not None and not isinstance(content, str):
            raise ValueError(
                f"messages[{i}].content must be a string or a list of text parts, "
                f"got {type(content).__name__}"
            )
        out.append({**msg, "content": content})
    return out


def content_spans(
    variables: dict[str, Any], source: str, text: str
) -> list[tuple[int, int]] | None:
    """Character spans of the messages' contents in ``text`` (the template's rendering of
    ``variables``), found by rendering each content as a unique marker; ``None`` when putting
    the contents (as they are, or stripped) back in place of the markers does not give
    ``text`` back (the template transforms a content)."""
    nonce = secrets.token_hex(8)
    messages = variables["messages"]
    probe = [
        {**m, "content": f"\ue000{nonce}{i}\ue001"} if isinstance(m.get("content"), str) else m
        for i, m in enumerate(messages)
    ]
    try:
        layout = compile_template(source).render(**{**variables, "messages": probe})
    except jinja2.TemplateError:
        return None
    parts = re.split(f"\ue000{nonce}(\\d+)\ue001", layout)
    for strip in (False, True):
        spans = []
        pos = 0
        rebuilt = []
        for j, part in enumerate(parts):
            if j % 2:
                content = messages[int(part)]["content"]
                piece = content.strip() if strip else content
                spans.append((pos, pos + len(piece)))
            else:
                piece = part
            rebuilt.append(piece)
            pos += len(piece)
        if "".join(rebuilt) == text:
            return spans
    return None


def final_message_end(messages: list[Message], text: str) -> int:
    """Where ``text`` (a rendering of ``messages``) is cut to continue the last message: right
    after the last occurrence of its content (stripped; its trailing whitespace kept where the
    rendering kept it), so the end-of-turn markup after it goes (transformers'
    ``continue_final_message``).

    Raises:
        ValueError: the last message has no text, or the rendering does not hold it (the
            template dropped or changed it).
    """
    content = messages[-1].get("content") if messages else None
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message: the final message has no text to continue")
    at = text.rfind(content.strip())
    if at == -1:
        raise ValueError(
            "continue_final_message: the chat template does not render the final message's "
            "text as it is, so it cannot be continued"
        )
    kept = content.lstrip()
    if text[at : at + len(kept)] == kept:
        return at + len(kept)
    return at + len(content.strip())


def _text_part(part: Any, i: int) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    raise ValueError(f"messages[{i}].content: only text parts are supported, got {part!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ValueError(f"invalid chat template: {exc}") from exc
