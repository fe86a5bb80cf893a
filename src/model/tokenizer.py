"""Tokenizer: HF ``tokenizers`` fast tokenizer plus ``tokenizer_config.json`` and chat templates."""

from __future__ import annotations

import bisect
import json
import re
import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

import jinja2
import structlog
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

_log = structlog.get_logger()

#: Texts of at least this many characters are encoded through the binding's
#: ``encode_batch``, which releases the GIL while Rust encodes (its ``encode``
#: keeps it), so a long prompt encoded on a worker thread does not stall the
#: event loop; below it ``encode`` is cheaper (no hop to the Rayon pool).
RELEASE_GIL_MIN_CHARS = 1024


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable-unicode table used by byte-level BPE."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _raise_exception(message: str) -> None:
    """``raise_exception`` helper available to chat templates, as in transformers."""
    raise TemplateError(message)


def _strftime_now(format: str) -> str:
    """``strftime_now`` helper of chat templates, as in transformers (Llama 3.1+
    templates date their system message with it): the local time, formatted."""
    import datetime

    return datetime.datetime.now().strftime(format)


def _tojson(value: Any, indent: int | None = None) -> str:
    """``tojson`` filter that, like transformers', keeps non-ASCII text readable."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """A checkpoint's tokenizer: ``tokenizer.json`` plus ``tokenizer_config.json``.

    Token ids are Python ints. Special tokens are those the ``tokenizer.json`` marks
    special (e.g. ``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>`` for SmolLM2).

    Threads: one object serves the tokenizer actor's pool (prompts and chat
    templates), the detokenizer on the event loop (decoding), and the API's
    worker threads (``/tokenize``, ``/detokenize``, echo). That is safe
    because nothing it holds changes after construction but two lazily
    computed values (``max_token_bytes``, ``min_tokens_per_message``), each
    a pure function of the tokenizer, so two threads computing one at once
    store the same number; the Hugging Face ``tokenizers`` objects are
    ``Send + Sync`` in Rust and take no Python-side lock; compiled templates
    are cached by source (``_compile_template``, an ``lru_cache``, whose
    lookups are thread-safe) and a ``jinja2.Template`` renders re-entrantly.

    Args:
        path: checkpoint folder holding ``tokenizer.json`` and, optionally,
            ``tokenizer_config.json``.
        chat_template: a Jinja chat template used instead of the checkpoint's
            (``--chat-template``); None keeps the checkpoint's, if any.

    Raises:
        FileNotFoundError: no ``tokenizer.json``.
    """

    def __init__(self, path: Path, chat_template: str | None = None) -> None:
        path = Path(path)
        self._tok = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        # A twin that encodes special-token strings as plain text (message
        # content must not be able to write the template's own markers).
        self._tok_text = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        self._tok_text.encode_special_tokens = True
        config_path = path / "tokenizer_config.json"
        self._config: dict[str, Any] = (
            json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {})
        self.bos_token: str | None = _token_content(self._config.get("bos_token"))
        self.eos_token: str | None = _token_content(self._config.get("eos_token"))
        self.chat_template: str | None = chat_template or self._config.get("chat_template")
        self.add_bos_token: bool = bool(self._config.get("add_bos_token", False))
        self._max_token_bytes: int | None = None
        self._min_tokens_per_message: int | None = None
        #: A template to suggest when there is none (set by start-up: the one
        #: kvserve ships for the model), named in chat's 400.
        self.chat_template_hint: str | None = None
        self._special_ids = frozenset(
            i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special)
        self._added_ids = frozenset(self._tok.get_added_tokens_decoder())
        #: SentencePiece-style vocabulary (``"▁"`` for a space, ``<0xAB>``
        #: byte-fallback pieces; ``gguf_tokenizer.build_spm_tokenizer``)
        #: rather than GPT-2's byte-level alphabet.
        self._spm = bool(getattr(self._tok.model, "byte_fallback", False))

    # ------------------------------------------------------------------ properties

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        """Id of the BOS token named in tokenizer_config.json, or None."""
        return self._tok.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def eos_token_id(self) -> int | None:
        """Id of the EOS token named in tokenizer_config.json, or None."""
        return self._tok.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def all_special_ids(self) -> list[int]:
        """Sorted ids of all special tokens."""
        return sorted(self._special_ids)

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = False,
               parse_special: bool = True) -> list[int]:
        """Token ids of ``text``.

        Special-token strings inside ``text`` (e.g. ``<|im_start|>``) map to
        their ids; with ``parse_special=False`` they are encoded as ordinary
        text instead (llama.cpp's ``parse_special``). With
        ``add_special_tokens``, BOS is prepended only if tokenizer_config.json
        says ``add_bos_token: true`` (SmolLM2 says false, so nothing is added).
        Texts of ``RELEASE_GIL_MIN_CHARS`` or more are encoded without holding
        the GIL (same ids).
        """
        ids = self._encoding(text, parse_special).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    @property
    def max_token_bytes(self) -> int:
        """Most UTF-8 bytes any one token stands for: an upper bound on the
        characters a token covers, so a text of more than ``n *
        max_token_bytes`` characters has more than ``n`` tokens (computed
        once, ~50 ms over the vocabulary)."""
        if self._max_token_bytes is None:
            self._max_token_bytes = max(len(self.id_to_bytes(i)) for i in range(self.vocab_size))
        return self._max_token_bytes

    def check_chat_template(self) -> None:
        """Render a one-message chat with the chat template (none: nothing to
        check), and measure :attr:`min_tokens_per_message` while at it, so
        that a template that cannot render a chat fails here, before
        serving, and not in every request (or on the event loop).

        Raises:
            ValueError: one line, for a template that ran past its budget,
                recursed too deep or asked for too large a range (what would
                hold a thread or crash at every request); other template
                errors are left to the requests that meet them (a template
                may refuse some chats on purpose, with ``raise_exception``).
        """
        if not self.chat_template:
            return
        try:
            self.apply_chat_template([{"role": "user", "content": "Hi"}])
        except ValueError as exc:
            text = str(exc)
            if any(word in text for word in ("took more than", "recursed too deep",
                                              "OverflowError", "MemoryError")):
                raise ValueError(f"the chat template cannot render a one-message chat: {text}; "
                                 "pass --chat-template PATH with another (or fix the one "
                                 "given)") from None
        _ = self.min_tokens_per_message

    @property
    def min_tokens_per_message(self) -> int:
        """Fewest tokens one more chat message adds, by this chat template
        (1 when it cannot tell): a lower bound that refuses a chat of more
        messages than the context can hold before rendering it.

        Measured once per role (``system``, ``user``, ``assistant``) as the
        tokens of two empty messages of that role minus those of one; the
        smallest wins, so any mix of roles costs at least this per message.
        A template that refuses a role twice in a row cannot be measured
        that way and gives no figure (ChatML-style templates accept it).
        """
        if self._min_tokens_per_message is None:
            costs = []
            for role in ("system", "user", "assistant"):
                try:
                    one, two = (len(self.encode(self.apply_chat_template(
                        [{"role": role, "content": ""}] * k, add_generation_prompt=False,
                        render_budget_s=PROBE_BUDGET_S)))
                        for k in (1, 2))
                except TemplateBudgetExceeded:
                    _log.warning("chat_template_slow", role=role,
                                 message=f"The chat template took more than {PROBE_BUDGET_S:g} "
                                         f"s to render two {role} messages: chats of several "
                                         "messages will be slow, or refused")
                    break
                except ValueError:
                    continue
                costs.append(two - one)
            self._min_tokens_per_message = max(1, min(costs)) if costs else 1
        return self._min_tokens_per_message

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` with special-token strings in it encoded as
        ordinary text (``<|im_start|>`` becomes the tokens of those characters,
        not the control token), as llama.cpp does with ``parse_special=false``."""
        return self.encode(text, parse_special=False)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, render_budget_s: float | None = None,
                    **kwargs: Any) -> list[int]:
        """Token ids of ``messages`` rendered by the chat template, where only
        the template's own text may hold special tokens: a user cannot forge
        a turn (``<|im_end|>\n<|im_start|>system``) from inside a message.

        When no message content holds a special-token string (encoded alone,
        none of its ids is special), the template renders the real messages
        and the prompt is encoded whole, as HF and vLLM do: a template that
        transforms content (Qwen3's ``content.split('</think>')``,
        ``content|upper``, ``content[:n]``, ``startswith``) acts on the real
        text. Only when some content holds one does the template render with
        a placeholder for each string ``content``, which gives the character
        span of every content in the prompt; if a special token then falls
        inside a content span, the prompt is encoded piecewise: the
        template's text with special tokens parsed, each content by
        :meth:`encode_text` (a template that transforms such a content sees
        the placeholder: the safe side).

        ``continue_final_message`` (vLLM's assistant prefill): the last
        message (an assistant's, a string) is left open for the model to
        continue: rendered without a generation prompt, the prompt ends
        where that message's content ends (vLLM cuts at the content's last
        occurrence, as here). ``render_budget_s``: the render's budget
        (:meth:`apply_chat_template`). Raises ``ValueError`` as
        :meth:`apply_chat_template` does, and for a last message without
        string content under ``continue_final_message``.
        """
        final = None
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str) or not final:
                raise ValueError("continue_final_message needs a last message with text to "
                                 "continue")
            add_generation_prompt = False
        if not any(isinstance(m.get("content"), str) and self._holds_special(m["content"])
                   for m in messages):
            prompt = self.apply_chat_template(messages, add_generation_prompt,
                                              render_budget_s=render_budget_s, **kwargs)
            if final is not None:
                end = prompt.rfind(final)
                if end < 0:
                    raise ValueError("continue_final_message: the chat template does not "
                                     "render the last message's text as it is")
                prompt = prompt[:end + len(final)]
            return self._encoding(prompt).ids
        contents: list[str] = []
        masked = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, str):
                masked.append({**message, "content": f"{_SLOT_OPEN}{len(contents)}{_SLOT_CLOSE}"})
                contents.append(content)
            else:
                masked.append(message)
        pieces = _SLOT_RE.split(self.apply_chat_template(
            masked, add_generation_prompt, render_budget_s=render_budget_s, **kwargs))
        if final is not None:  # the prompt ends with the last content's slot
            pieces = pieces[:2 * len(contents)]
        parts = [contents[int(p)] if i % 2 else p for i, p in enumerate(pieces)]
        starts, ends, at = [], [], 0
        for i, part in enumerate(parts):
            if i % 2:
                starts.append(at)
                ends.append(at + len(part))
            at += len(part)
        whole = self._encoding("".join(parts))
        if not any(token in self._special_ids and _inside(begin, starts, ends)
                   for token, (begin, _) in zip(whole.ids, whole.offsets)):
            return whole.ids
        return [t for i, part in enumerate(parts) if part
                for t in (self.encode_text(part) if i % 2 else self.encode(part))]

    def _holds_special(self, text: str) -> bool:
        """Whether ``text`` encodes to any special token (a special-token string in it)."""
        return any(t in self._special_ids for t in self._encoding(text).ids)

    def _encoding(self, text: str, parse_special: bool = True) -> Any:
        """The HF ``Encoding`` of ``text`` (special-token strings parsed, or
        text), without the GIL for long texts (see :meth:`encode`)."""
        tok = self._tok if parse_special else self._tok_text
        if len(text) >= RELEASE_GIL_MIN_CHARS:
            return tok.encode_batch([text], add_special_tokens=False)[0]
        return tok.encode(text, add_special_tokens=False)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are left out when ``skip_special_tokens``.

        A token sequence that ends inside a multi-byte UTF-8 character decodes to
        U+FFFD for the partial bytes; use :meth:`id_to_bytes` for incremental output.
        """
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        """Vocabulary strings of ``ids`` (byte-level alphabet, e.g. ``'Ġthe'``); None if unknown."""
        return [self._tok.id_to_token(i) for i in ids]

    def id_to_bytes(self, token_id: int) -> bytes:
        """Raw UTF-8 bytes that token ``token_id`` stands for.

        Concatenating the bytes of a sequence and decoding once gives the same text as
        :meth:`decode` with ``skip_special_tokens=False``; a single token may hold an
        incomplete UTF-8 character (e.g. one byte of an emoji). Special and added
        tokens give their literal text.

        Raises:
            ValueError: ``token_id`` is out of range.
        """
        token = self._tok.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is out of range (vocab size {self.vocab_size})")
        if token_id in self._special_ids:
            return token.encode("utf-8")
        if self._spm:
            if token_id in self._added_ids:
                return token.encode("utf-8")
            match = _BYTE_PIECE.fullmatch(token)
            if match is not None:
                return bytes([int(match.group(1), 16)])
            return token.replace("\u2581", " ").encode("utf-8")
        table = _byte_decoder()
        try:
            return bytes(table[ch] for ch in token)
        except KeyError:  # an added token outside the byte-level alphabet
            return token.encode("utf-8")

    # ------------------------------------------------------------------ chat template

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            render_budget_s: float | None = None, **kwargs: Any) -> str:
        """Render ``messages`` with the checkpoint's Jinja chat template.

        Rendering uses jinja2's ``ImmutableSandboxedEnvironment`` with ``trim_blocks``
        and ``lstrip_blocks`` as transformers does; the template sees ``messages``,
        ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``raise_exception``,
        ``strftime_now`` and any extra ``kwargs`` (e.g. ``tools``,
        ``enable_thinking``).

        Returns:
            The prompt text; encode it with :meth:`encode` (special-token strings in it
            become their ids).

        A render has ``render_budget_s`` seconds (default
        :data:`TEMPLATE_BUDGET_S`): a template that loops longer (a nested
        loop, on purpose or not) is stopped between two of its lines
        (:func:`_render_within`) with :class:`TemplateBudgetExceeded`, so that
        it cannot hold a thread, the event loop or start-up for long.

        Raises:
            ValueError: there is no chat template, the template is invalid or unsafe,
                it called ``raise_exception``, ran past its budget, recursed too
                deep or asked for too large a range.
        """
        if not self.chat_template:
            raise ValueError(NO_CHAT_TEMPLATE)
        try:
            template = _compile_template(self.chat_template)
            budget = TEMPLATE_BUDGET_S if render_budget_s is None else render_budget_s
            return _render_within(template, budget, messages=messages,
                                  add_generation_prompt=add_generation_prompt,
                                  bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                  **kwargs)
        except SecurityError as exc:
            raise ValueError(f"unsafe chat template: {exc}") from exc
        except _TemplateOverBudget as exc:
            raise TemplateBudgetExceeded(f"chat template error: {exc}") from exc
        except TemplateError as exc:
            raise ValueError(f"chat template error: {exc}") from exc
        except RecursionError:
            raise ValueError("chat template error: it recursed too deep") from None
        except (OverflowError, MemoryError) as exc:
            raise ValueError(f"chat template error: {type(exc).__name__}: "
                             f"{str(exc)[:200]}") from None


#: Seconds one chat-template render may take (a 4,000-message chat renders
#: in well under one on the 2-core machine).
TEMPLATE_BUDGET_S = 5.0
#: Seconds each render of the start-up probe (``min_tokens_per_message``)
#: may take: a template that loops on two messages cost 15 s of start-up.
PROBE_BUDGET_S = 0.5


class _TemplateOverBudget(TemplateError):
    """A render that ran past its budget (inside Jinja)."""


class TemplateBudgetExceeded(ValueError):
    """A chat-template render stopped at its budget (``apply_chat_template``)."""


def _render_within(template: jinja2.Template, seconds: float, **context: Any) -> str:
    """``template.render(**context)``, stopped with ``_TemplateOverBudget``
    once it has run ``seconds``: a trace function on this thread checks the
    clock at every line the compiled template executes (Jinja compiles a
    template to Python code named ``<template>``; other frames are not
    traced), so a loop is stopped between two iterations. The thread's
    previous trace function (a debugger, coverage) is restored after."""
    deadline = time.monotonic() + seconds

    def line(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise _TemplateOverBudget(f"rendering took more than {seconds:g} s "
                                      "(a loop that does not end?)")
        return line

    def call(frame: Any, event: str, arg: Any) -> Any:
        return line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(call)
    try:
        return template.render(**context)
    finally:
        sys.settrace(previous)


#: Why a chat cannot be rendered for a model without a template: the same
#: words in every refusal (``kvserve.api.serving`` answers 400 with them).
NO_CHAT_TEMPLATE = ("this model has no chat template (none in its tokenizer_config.json or "
                    "GGUF); start the server with --chat-template PATH to give one, or use "
                    "/v1/completions with a plain prompt")

#: A SentencePiece byte-fallback piece, ``<0x0A>``.
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _inside(offset: int, starts: list[int], ends: list[int]) -> bool:
    """Whether character ``offset`` lies in one of the spans ``[starts[i],
    ends[i])``, which are sorted and disjoint: a binary search, so checking
    every special token of a chat costs O(tokens log messages), not
    O(tokens x messages) (4,000 messages took 46 s that way)."""
    i = bisect.bisect_right(starts, offset) - 1
    return i >= 0 and offset < ends[i]


#: Placeholders for message contents while the template renders (Unicode
#: private-use characters, which no tokenizer merges with their neighbours'
#: meaning); ``_SLOT_RE.split`` gives text, index, text, index, ...
_SLOT_OPEN, _SLOT_CLOSE = "\ue000kvserve-content-", "\ue001"
_SLOT_RE = re.compile(re.escape(_SLOT_OPEN) + r"(\d+)" + re.escape(_SLOT_CLOSE))


@lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox, once per distinct source."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
