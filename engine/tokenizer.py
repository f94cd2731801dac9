"""Tokenizer on the Hugging Face ``tokenizers`` library, with jinja2 chat templates.

Reads the same files as transformers' fast tokenizers (``tokenizer.json`` and
``tokenizer_config.json``, optionally ``chat_template.jinja`` and ``generation_config.json``) and
gives the same ids; special tokens in the content of chat messages stay plain text
(``encode_chat``). The templates render in ``chat_template.py`` (a sandboxed jinja2
environment configured like transformers'); byte facts of the vocabulary are in
``token_bytes.py``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, overload

import jinja2
from prefixgate.engine.chat_template import (
    Message,
    compile_template,
    content_spans,
    final_message_end,
    normalize_messages,
)
from prefixgate.engine.models.errors import ModelFileNotFoundError
from prefixgate.engine.models.presets import TINY_CHAT_TEMPLATE, build_tiny_tokenizer
from prefixgate.engine.token_bytes import max_token_bytes, unicode_to_bytes
from tokenizers import Tokenizer as HFTokenizer

__all__ = ["MAX_CACHED_WORDS", "Message", "Tokenizer", "bound_word_cache", "normalize_messages"]

MAX_CACHED_WORDS = 4096
"""At most this many words in a ``tokenizers`` model's word cache (BPE, Unigram: a word's
pieces kept by its text, up to 256 characters a word; ``tokenizers``' own cap is 10,000). A
word of ``c`` characters costs ~33·c bytes there (measured: ~1.5 KB for 45 characters), so the
cache holds at most ~35 MB and, for words of real pre-tokenized text (a few characters), ~2 MB."""


def bound_word_cache(tok: HFTokenizer) -> int:
    """Bound ``tok``'s word cache (in place); return its capacity in words.

    With a pre-tokenizer, the cache holds up to ``MAX_CACHED_WORDS`` words. Without one (the
    ``tiny-random`` preset), a "word" is a whole text between special tokens, nearly every
    prompt a new one never hit again: there the cache is off (capacity 0), or it would keep
    ~1.5 KB for each of the first 10,000 distinct prompts. Models without a word cache
    (WordPiece, WordLevel) are left as they are (0 is returned).
    """
    model = tok.model
    if not hasattr(model, "_resize_cache"):
        return 0
    capacity = MAX_CACHED_WORDS if tok.pre_tokenizer is not None else 0
    model._resize_cache(capacity)
    return capacity


class Tokenizer:
    """Text ↔ token ids, special tokens and the chat template of one model.

    Build with :meth:`from_pretrained` (a model directory) or :meth:`builtin` (the
    ``tiny-random`` preset's tokenizer, no files). Thread-safe for encode/decode.

    Attributes:
        bos_token / eos_token / unk_token / pad_token: special token strings or ``None``.
        bos_token_id: id of ``bos_token`` or ``None``.
        eos_token_ids: ids that end generation (``eos_token`` plus generation_config.json's).
        vocab_size: number of ids, added tokens included.
        chat_template: the default template source, or ``None``.
    """

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        chat_templates: dict[str, str] | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        bound_word_cache(tokenizer)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.unk_token = unk_token
        self.pad_token = pad_token
        self.chat_templates = dict(chat_templates or {})
        self.bos_token_id = self._id(bos_token)
        self.eos_token_id = self._id(eos_token)
        self.eos_token_ids: set[int] = set(extra_eos_token_ids)
        if self.eos_token_id is not None:
            self.eos_token_ids.add(self.eos_token_id)
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.all_special_ids: set[int] = {
            i
            for tok in tokenizer.get_added_tokens_decoder().values()
            if tok.special and (i := self._id(tok.content)) is not None
        }
        self._special_texts = sorted(
            {tok.content for tok in tokenizer.get_added_tokens_decoder().values() if tok.special}
        )
        self._plain: HFTokenizer | None = None  # a copy that reads special tokens as text
        # tokenizer.json's post-processor decides what add_special_tokens adds (as in
        # transformers' fast tokenizers); add_bos_token/add_eos_token only fill in what it lacks.
        probe = tokenizer.encode("", add_special_tokens=True).ids
        self._prepend_bos = (
            bool(add_bos_token)
            and self.bos_token_id is not None
            and (not probe or probe[0] != self.bos_token_id)
        )
        self._append_eos = (
            bool(add_eos_token)
            and self.eos_token_id is not None
            and (not probe or probe[-1] != self.eos_token_id)
        )

    # -- construction --------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` + ``tokenizer_config.json`` from a model directory.

        The chat template comes from ``tokenizer_config.json`` (a string, or a list of
        ``{"name", "template"}``) or from ``chat_template.jinja``. EOS ids of
        ``generation_config.json`` are added to ``eos_token_ids``.

        Raises:
            ModelFileNotFoundError: the directory or ``tokenizer.json`` is missing.
            ValueError: a config file is not valid JSON.
        """
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not root.is_dir():
            raise ModelFileNotFoundError(f"model directory {str(root)!r} does not exist")
        if not tok_file.is_file():
            raise ModelFileNotFoundError(f"missing {tok_file} (only fast tokenizers are supported)")
        config = _read_json(root / "tokenizer_config.json")
        templates = _templates(config.get("chat_template"))
        jinja_file = root / "chat_template.jinja"
        if "default" not in templates and jinja_file.is_file():
            templates["default"] = jinja_file.read_text()
        generation = _read_json(root / "generation_config.json")
        eos = generation.get("eos_token_id")
        extra_eos = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(
            HFTokenizer.from_file(str(tok_file)),
            bos_token=_token(config.get("bos_token")),
            eos_token=_token(config.get("eos_token")),
            unk_token=_token(config.get("unk_token")),
            pad_token=_token(config.get("pad_token")),
            chat_templates=templates,
            add_bos_token=config.get("add_bos_token"),
            add_eos_token=config.get("add_eos_token"),
            extra_eos_token_ids=extra_eos,
        )

    @classmethod
    def builtin(cls) -> Tokenizer:
        """The ``tiny-random`` preset's character-level tokenizer (no files; see presets)."""
        return cls(
            build_tiny_tokenizer(),
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            chat_templates={"default": TINY_CHAT_TEMPLATE},
        )

    # -- text <-> ids --------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the BOS (etc.) the tokenizer adds.

        Special tokens written in ``text`` (e.g. ``"<s>"``) map to their ids.

        Raises:
            TypeError: ``text`` is not a string.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            bos, eos = self.bos_token_id, self.eos_token_id
            if self._prepend_bos and bos is not None:
                ids.insert(0, bos)
            if self._append_eos and eos is not None:
                ids.append(eos)
        return ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` with special-token strings read as plain text (``"<s>"`` is
        ``<``, ``s``, ``>``), no special token added: transformers' ``split_special_tokens``.

        Raises:
            TypeError: ``text`` is not a string.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}")
        if self._plain is None:
            plain = HFTokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            bound_word_cache(plain)
            self._plain = plain
        return self._plain.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """:meth:`encode` for several texts (parallel inside ``tokenizers``)."""
        if self._prepend_bos or self._append_eos:
            return [self.encode(t, add_special_tokens) for t in texts]
        return [
            e.ids
            for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        ]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; incomplete UTF-8 byte sequences decode to U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on ``len(self.encode(text))``, in O(len(text)) without tokenizing
        (0 when this tokenizer admits no safe bound).

        A token never covers more than ``max_token_bytes`` bytes of the normalized text,
        so ``encode`` emits at least ``ceil(utf8_bytes / (max_token_bytes * shrink))``
        tokens, where ``shrink`` bounds how much the normalizer can shorten the text (1 for
        the ``Prepend``/space-``Replace`` of SentencePiece-style tokenizers, 3 for Unicode
        normalization forms). Lets a server refuse a prompt that cannot fit the context before
        spending seconds and gigabytes tokenizing it.
        """
        per_token = self.max_token_bytes
        if not per_token:
            return 0
        return -(-len(text.encode("utf-8", "surrogatepass")) // per_token)

    @property
    def max_token_bytes(self) -> int:
        """Most UTF-8 bytes of input text one token can stand for, times the normalizer's
        worst shrink factor; 0 when no bound is safe (a normalizer or pre-tokenizer that can
        drop text, a model that fuses unknown text into one token). Computed once from the
        vocabulary (added tokens included): a vocabulary string's UTF-8 length is at least
        the bytes it covers (a byte-level symbol is 1-2 UTF-8 bytes for one byte, ``▁`` 3
        bytes for one space, ``<0x0A>`` 6 characters for one byte)."""
        value = getattr(self, "_max_token_bytes", None)
        if value is None:
            value = max_token_bytes(self._tok)
            self._max_token_bytes = value
        return value

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of ``token_id`` (e.g. ``"▁the"``, ``"<0x0A>"``), or ``None``."""
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` adds to the text, its leading space included: a byte-fallback
        token ``<0xC3>`` is ``b"\\xc3"`` (not U+FFFD), a byte-level BPE token (GPT-2, Qwen)
        maps back through GPT-2's byte-to-unicode table, a sentencepiece ``▁`` is a space.
        Special tokens give their text. Unknown ids give ``b""``.
        """
        token = self._tok.id_to_token(token_id)
        if token is None:
            return b""
        if token_id in self.all_special_ids:
            return token.encode()
        kinds = self._decoder_kinds
        if "ByteFallback" in kinds and len(token) == 6 and token.startswith("<0x"):
            try:
                return bytes([int(token[3:5], 16)])
            except ValueError:
                pass
        if "ByteLevel" in kinds:
            table = unicode_to_bytes()
            if all(ch in table for ch in token):
                return bytes(table[ch] for ch in token)
        if "Metaspace" in kinds or "Replace" in kinds:
            token = token.replace("\u2581", " ")
        return token.encode()

    @property
    def _decoder_kinds(self) -> set[str]:
        kinds = getattr(self, "_kinds", None)
        if kinds is None:
            decoder = json.loads(self._tok.to_str()).get("decoder") or {}
            kinds = {d.get("type") for d in [decoder, *decoder.get("decoders", [])]}
            self._kinds = kinds
        return kinds

    def __len__(self) -> int:
        return self.vocab_size

    # -- chat ----------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The default chat template source, or ``None`` when the tokenizer has none."""
        return self.chat_templates.get("default")

    @overload
    def apply_chat_template(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        *,
        tokenize: Literal[False] = False,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str: ...

    @overload
    def apply_chat_template(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        *,
        tokenize: Literal[True],
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> list[int]: ...

    def apply_chat_template(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        *,
        tokenize: bool = False,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render a conversation with the chat template (transformers' semantics).

        Args:
            messages: ``[{"role": str, "content": str | list of {"type": "text", "text": str}
                | None, ...}]``; text parts are joined into one string.
            add_generation_prompt: end with the assistant turn's opening.
            tokenize: return token ids instead of text. The rendered text already holds the
                template's special tokens, so it is encoded with ``add_special_tokens=False``
                (as transformers does); callers encoding the text themselves must do the same.
            chat_template: a named template (e.g. ``"tool_use"``) or a template source;
                default the tokenizer's ``"default"`` template.
            continue_final_message: end the rendering right after the last message's content
                (its end-of-turn markup cut), so the model continues that message
                (transformers' semantics); not with ``add_generation_prompt``.
            **kwargs: extra template variables (e.g. ``tools``, ``documents``).

        Raises:
            ValueError: no chat template, malformed messages, the template raised, both
                ``add_generation_prompt`` and ``continue_final_message``, or a final message
                whose text the rendering does not hold.
            TypeError: ``messages`` is not a list of dicts.
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if chat_template is None and kwargs.get("tools") and "tool_use" in self.chat_templates:
            chat_template = "tool_use"  # transformers picks the tool template the same way
        source = self.chat_templates.get(chat_template or "default", chat_template)
        if not source:
            raise ValueError("this tokenizer has no chat template; pass a prompt instead")
        variables = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "unk_token": self.unk_token or "",
            "pad_token": self.pad_token or "",
            **kwargs,
            "messages": normalize_messages(messages),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            text = compile_template(source).render(**variables)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc
        full = text
        if continue_final_message:
            text = text[: final_message_end(variables["messages"], text)]
        if tokenize:
            return self._encode_rendered(variables, source, text, full)
        return text

    def encode_chat(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of a conversation: ``apply_chat_template(..., tokenize=True)``.

        Only the template's own markup yields special tokens: a special-token string inside a
        message's content (``"<s>"``, a fake ``"<|im_start|>system"``) is tokenized as plain
        text, so user text can never forge a BOS, a role boundary or an end of turn. Without
        such strings in the content the ids are exactly transformers' (one ``encode`` of the
        rendered text, ``add_special_tokens=False``).

        How: the rendered text is encoded once with offsets; each special token lying inside a
        message's content span is user text. The content spans come from a second render with
        each content replaced by a unique marker (the template's layout), checked to rebuild
        the real rendering exactly. The text between two markup special tokens that holds such
        a token is re-encoded with special tokens read as text (``encode_plain``); every
        other token is kept. (vLLM and transformers tokenize the whole rendering with special
        tokens, so user text can produce them there.)

        Raises:
            ValueError: no chat template, malformed messages, the template raised, or a content
                holding a special-token string that the template changes (trims, escapes) so
                that its place in the rendering cannot be found.
            TypeError: ``messages`` is not a list of dicts.
        """
        return self.apply_chat_template(
            messages,
            add_generation_prompt,
            tokenize=True,
            chat_template=chat_template,
            continue_final_message=continue_final_message,
            **kwargs,
        )

    def _encode_rendered(
        self, variables: dict[str, Any], source: str, text: str, full: str | None = None
    ) -> list[int]:
        """Ids of ``text`` (rendered from ``variables``; a prefix of that rendering ``full``
        when cut by ``continue_final_message``) with content special tokens as text."""
        enc = self._tok.encode_batch([text], add_special_tokens=False)[0]
        ids = enc.ids
        specials = [k for k, i in enumerate(ids) if i in self.all_special_ids]
        messages = variables["messages"]
        if not specials or not any(self._holds_special(m.get("content")) for m in messages):
            return ids
        spans = content_spans(variables, source, full if full is not None else text)
        if spans is None:
            raise ValueError(
                "a message's content holds a special-token string and the chat template "
                "changes the content, so it cannot be kept as plain text: remove the "
                f"special-token strings ({', '.join(self._special_texts[:8])})"
            )
        offsets = enc.offsets
        injected = {
            k for k in specials if any(a <= offsets[k][0] and offsets[k][1] <= b for a, b in spans)
        }
        if not injected:
            return ids
        out: list[int] = []
        tok, char = 0, 0
        for k in [k for k in specials if k not in injected] + [len(ids)]:
            end = offsets[k][0] if k < len(ids) else len(text)
            if any(tok <= j < k for j in injected):
                out.extend(self.encode_plain(text[char:end]))
            else:
                out.extend(ids[tok:k])
            if k < len(ids):
                out.append(ids[k])
                tok, char = k + 1, offsets[k][1]
        return out

    def holds_special_text(self, text: str) -> bool:
        """True when ``text`` holds the string of a special token (``"<s>"``,
        ``"<|im_start|>"``)."""
        return any(t in text for t in self._special_texts)

    def _holds_special(self, content: Any) -> bool:
        return isinstance(content, str) and any(t in content for t in self._special_texts)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


def _token(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _templates(value: Any) -> dict[str, str]:
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {
            t["name"]: t["template"]
            for t in value
            if isinstance(t, dict) and "name" in t and "template" in t
        }
    return {}
