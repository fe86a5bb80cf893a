"""OpenAI response objects and stream chunks: what a choice accumulated
(``ChoiceState``), usage, logprobs, tool-call replies and the ``Renderer``
that writes ``chat.completion`` / ``chat.completion.chunk`` and
``text_completion`` objects (the request models are ``kvserve.api.protocol``'s).

Formats follow the OpenAI API reference: the ``chat.completion`` object
(https://platform.openai.com/docs/api-reference/chat/object), its stream
chunk (/chat/streaming) and the legacy ``text_completion`` object
(/completions/object), also used for its stream chunks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvserve.actors.detokenizer import TokenOffsets
from kvserve.actors.messages import RequestOutput
from kvserve.api.protocol import TokenBytes, TokenText, ToolReply
from kvserve.api.reasoning import ReasoningStream, split_reasoning
from kvserve.api.tool_calls import FORMATS, ToolCallStream, parse_tool_calls


@dataclass
class ChoiceState:
    """What the API accumulated for one choice (``index``).

    ``text_offsets`` has one character offset per token of ``token_ids`` in
    the choice's text (from the engine's ``RequestOutput.text_offsets``).
    """

    index: int
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[Any] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)
    prompt_logprobs: tuple[Any, ...] | None = None
    num_chars: int = 0
    echoed: bool = False
    tool_stream: ToolCallStream | None = None
    reasoning_stream: ReasoningStream | None = None

    def add(self, output: RequestOutput, token_text: TokenText | None = None) -> list[int]:
        """Fold one ``RequestOutput`` of this choice in; returns its tokens' offsets.

        An engine that sends no ``text_offsets`` gets offsets counted from
        the token texts (``token_text``), starting where this output's text starts.
        """
        offsets = list(output.text_offsets) if output.text_offsets is not None else None
        end = self.num_chars + len(output.text)
        if offsets is None or len(offsets) != len(output.token_ids):
            offsets, at = [], self.num_chars
            for token_id in output.token_ids:
                offsets.append(min(at, end))
                at += len(token_text(token_id)) if token_text is not None else 0
        self.num_chars = end
        self.text.append(output.text)
        self.token_ids.extend(output.token_ids)
        self.text_offsets.extend(offsets)
        if output.logprobs:
            self.logprobs.extend(output.logprobs)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason
        self.num_output_tokens = max(self.num_output_tokens, output.num_output_tokens,
                                     len(self.token_ids))
        self.num_prompt_tokens = max(self.num_prompt_tokens, output.num_prompt_tokens)
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        return offsets


def usage_object(choices: Sequence[ChoiceState], num_prompt_tokens: int) -> dict[str, Any]:
    """OpenAI ``usage``: prompt, completion (all choices) and total tokens,
    plus ``prompt_tokens_details.cached_tokens`` (prefix-cache hits)."""
    prompt = max([num_prompt_tokens, *(c.num_prompt_tokens for c in choices)])
    completion = sum(c.num_output_tokens for c in choices)
    cached = max([0, *(c.num_cached_tokens for c in choices)])
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


#: The logprob shown for a token the model gives probability 0 (a
#: -inf log-softmax, e.g. a token masked by ``logit_bias`` -100 or top-k):
#: JSON has no infinity, and vLLM's OpenAI server shows the same floor.
MIN_LOGPROB = -9999.0


def finite_logprob(value: float) -> float:
    """``value`` floored at ``MIN_LOGPROB``; NaN stays NaN, so that the
    encoder (``allow_nan=False``) refuses it as the bug it is."""
    return MIN_LOGPROB if value < MIN_LOGPROB else value


def chat_logprobs(entries: Sequence[Any], token_ids: Sequence[int], token_text: TokenText,
                  token_bytes: TokenBytes, top_n: int) -> dict[str, Any]:
    """Chat ``logprobs`` (the ``chat.completion`` object's ``choices[].logprobs``):
    ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}``.

    ``entries`` are the engine's ``(sampled_logprob, ((token_id, logprob), ...))``,
    one per token of ``token_ids``; at most ``top_n`` alternatives are listed.
    ``token`` is the token's text (U+FFFD for a token holding part of a
    multi-byte character); ``bytes`` are the token's own UTF-8 bytes, so the
    ``bytes`` of consecutive tokens concatenate to the text, as the OpenAI
    reference defines them.
    """
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": token_text(token_id), "logprob": finite_logprob(logprob),
                "bytes": list(token_bytes(token_id))}

    content = []
    for token_id, (sampled, top) in zip(token_ids, entries):
        item = entry(token_id, sampled)
        item["top_logprobs"] = [entry(tid, lp) for tid, lp in top[:top_n]]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Sequence[Any], token_ids: Sequence[int],
                        offsets: Sequence[int], token_text: TokenText) -> dict[str, Any]:
    """Completions ``logprobs`` (the ``text_completion`` object): parallel lists
    ``tokens``, ``token_logprobs``, ``top_logprobs`` (one ``{token: logprob}``
    dict per token: the top alternatives plus the token itself) and
    ``text_offset`` (``offsets``: the character offset of each token in the
    choice's ``text``). An entry of None (the first prompt token under
    ``echo``) gives a null logprob and a null ``top_logprobs`` item.
    """
    result: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                              "text_offset": []}
    for token_id, entry, offset in zip(token_ids, entries, offsets):
        token = token_text(token_id)
        result["tokens"].append(token)
        result["text_offset"].append(offset)
        if entry is None:
            result["token_logprobs"].append(None)
            result["top_logprobs"].append(None)
            continue
        sampled, top = entry
        sampled = finite_logprob(sampled)
        result["token_logprobs"].append(sampled)
        alternatives = {token_text(tid): finite_logprob(lp) for tid, lp in top}
        alternatives.setdefault(token, sampled)
        result["top_logprobs"].append(alternatives)
    return result


def _merge_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + second[key] for key in first}


@dataclass
class Renderer:
    """Builds one endpoint's response objects (chat or completions).

    ``kind`` is ``"chat"`` or ``"completion"``; ``logprobs_top`` is the
    number of alternatives to list (None: no logprobs requested).
    ``echo_text`` (completions ``echo``) is the prompt text put before each
    choice's text; ``prompt_token_ids`` are set once the engine accepted
    the request. ``hidden_token_ids``: tokens the text leaves out (special
    tokens under ``skip_special_tokens``, e.g. the EOS ``<|im_end|>``), left
    out of chat logprobs too, so that their ``bytes`` join to the content.
    ``tools`` (set when tools are active): chat answers are parsed for tool
    calls (``kvserve.api.tool_calls``): they become ``message.tool_calls``
    (streamed as ``delta.tool_calls``, one complete call per delta), as
    ``ToolReply`` says; when the answer is forced to be calls, a block cut
    off by ``max_tokens`` is dropped, not returned as text.
    ``reasoning`` (``--reasoning-parser``): chat answers' thought goes into
    ``message.reasoning_content`` (``delta.reasoning_content``), out of the
    content, before tool calls are parsed (``kvserve.api.reasoning``).
    """

    kind: Literal["chat", "completion"]
    request_id: str
    model: str
    token_text: TokenText
    logprobs_top: int | None = None
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    token_bytes: TokenBytes | None = None
    echo: bool = False
    echo_text: str | None = None
    prompt_token_ids: tuple[int, ...] = ()
    hidden_token_ids: frozenset[int] = frozenset()
    tools: ToolReply | None = None  # parse <tool_call> blocks out of chat answers
    continuous_usage: bool = False  # usage so far in every chunk
    reasoning: str | None = None  # --reasoning-parser: <think> ... </think> out of chat content
    #: The prompt's logprobs, computed by sample 0 only (``fan_out``) and
    #: shared by every choice's ``echo``.
    shared_prompt_logprobs: tuple[Any, ...] | None = None
    _streamed: dict[int, ChoiceState] = field(default_factory=dict)

    @property
    def object_name(self) -> str:
        """``chat.completion`` or ``text_completion``."""
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def _bytes(self, token_id: int) -> bytes:
        if self.token_bytes is not None:
            return self.token_bytes(token_id)
        return self.token_text(token_id).encode("utf-8")

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_name, "created": self.created,
                "model": self.model}

    def _echo_prefix(self) -> str:
        return (self.echo_text or "") if self.echo else ""

    def _logprobs(self, entries: Sequence[Any], token_ids: Sequence[int],
                  offsets: Sequence[int]) -> dict[str, Any] | None:
        if self.logprobs_top is None or not entries:
            return None
        if self.kind == "chat":  # tokens the text leaves out (EOS) are not its content
            kept = [(e, t) for e, t in zip(entries, token_ids) if t not in self.hidden_token_ids]
            return chat_logprobs([e for e, _ in kept], [t for _, t in kept], self.token_text,
                                 self._bytes, self.logprobs_top)
        base = len(self._echo_prefix())
        return completion_logprobs(entries, token_ids, [base + o for o in offsets],
                                   self.token_text)

    def _prompt_logprobs(self, prompt_entries: Sequence[Any] | None) -> dict[str, Any]:
        """The echoed prompt's part of completions ``logprobs``."""
        ids = self.prompt_token_ids
        entries = list(prompt_entries or ())
        entries = (entries + [None] * len(ids))[: len(ids)]
        tracker = TokenOffsets(self._bytes, frozenset())
        limit = len(self._echo_prefix())
        offsets = [min(tracker.add(t), limit) for t in ids]
        return completion_logprobs(entries, ids, offsets, self.token_text)

    def response(self, choices: Sequence[ChoiceState], num_prompt_tokens: int) -> dict[str, Any]:
        """The non-streaming ``chat.completion`` / ``text_completion`` object."""
        body = self._envelope(self.object_name)
        self.shared_prompt_logprobs = next((c.prompt_logprobs for c in choices
                                            if c.prompt_logprobs is not None), None)
        body["choices"] = [self._full_choice(c) for c in sorted(choices, key=lambda c: c.index)]
        body["usage"] = usage_object(choices, num_prompt_tokens)
        return body

    def _full_choice(self, choice: ChoiceState) -> dict[str, Any]:
        text = "".join(choice.text)
        logprobs = self._logprobs(choice.logprobs, choice.token_ids, choice.text_offsets)
        if self.kind == "chat" and self.logprobs_top is not None and logprobs is None:
            logprobs = {"content": [], "refusal": None}
        if self.kind == "completion" and self.echo and self.logprobs_top is not None:
            prompt_part = self._prompt_logprobs(choice.prompt_logprobs
                                                or self.shared_prompt_logprobs)
            logprobs = prompt_part if logprobs is None else _merge_logprobs(prompt_part, logprobs)
        out: dict[str, Any] = {"index": choice.index}
        finish = choice.finish_reason
        if self.kind == "chat":
            out["message"] = {"role": "assistant", "content": text, "refusal": None}
            if self.reasoning is not None:
                thought, text = split_reasoning(text, self.reasoning)
                out["message"].update(content=text, reasoning_content=thought)
            if self.tools is not None:
                content, calls = parse_tool_calls(text, FORMATS[self.tools.format])
                if not self.tools.parallel:
                    calls = calls[:1]
                if self.tools.forced:
                    out["message"]["content"] = None
                if calls:
                    out["message"].update(tool_calls=calls)
                    if not self.tools.forced:
                        out["message"]["content"] = content
                finish = self.tools.finish(finish, bool(calls))
        else:
            out["text"] = self._echo_prefix() + text
        out["logprobs"] = logprobs
        out["finish_reason"] = finish
        return out

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        """Wrap one choice delta into a stream chunk."""
        name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = self._envelope(name)
        body["choices"] = [choice]
        if self.continuous_usage:
            body["usage"] = usage_object(list(self._streamed.values()),
                                         len(self.prompt_token_ids))
        elif self.include_usage:
            body["usage"] = None
        return body

    def role_chunk(self, index: int) -> dict[str, Any]:
        """Chat only: the first chunk of a choice, ``delta: {role, content: ""}``."""
        return self.chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                           "logprobs": None, "finish_reason": None})

    def delta_chunk(self, state: ChoiceState, output: RequestOutput) -> dict[str, Any] | None:
        """The chunk for one ``RequestOutput``, folding it into ``state``; None
        when it carries no text, no logprobs and no finish_reason.

        Under completions ``echo`` the choice's first chunk starts with the
        prompt text (and its logprobs).
        """
        offsets = state.add(output, self.token_text)
        self._streamed[state.index] = state
        if state.prompt_logprobs is not None and self.shared_prompt_logprobs is None:
            self.shared_prompt_logprobs = state.prompt_logprobs
        text = output.text
        logprobs = self._logprobs(output.logprobs or (), output.token_ids, offsets)
        if self.kind == "completion" and self.echo and not state.echoed:
            state.echoed = True
            text = self._echo_prefix() + text
            if self.logprobs_top is not None:
                prompt_part = self._prompt_logprobs(state.prompt_logprobs
                                                    or self.shared_prompt_logprobs)
                logprobs = (prompt_part if logprobs is None
                            else _merge_logprobs(prompt_part, logprobs))
        finish = output.finish_reason
        calls: list[dict[str, Any]] = []
        thought = ""
        if self.kind == "chat" and self.reasoning is not None:
            stream = state.reasoning_stream = (state.reasoning_stream
                                               or ReasoningStream(self.reasoning))
            thought, text = stream.feed(text)
            if finish is not None:
                more_thought, more_text = stream.finish()
                thought, text = thought + more_thought, text + more_text
        if self.kind == "chat" and self.tools is not None:
            text, calls, finish = self._tool_delta(self.tools, state, text, finish)
            if self.tools.forced:
                text = ""
        if not text and not thought and not calls and logprobs is None and finish is None:
            return None
        choice: dict[str, Any] = {"index": output.index}
        if self.kind == "chat":
            choice["delta"] = {"content": text} if text else {}
            if thought:
                choice["delta"]["reasoning_content"] = thought
            if calls:
                choice["delta"]["tool_calls"] = calls
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish
        return self.chunk(choice)

    @staticmethod
    def _tool_delta(tools: ToolReply, state: ChoiceState, text: str, finish: str | None
                    ) -> tuple[str, list[dict[str, Any]], str | None]:
        """A chat delta's content, its completed tool calls (OpenAI's
        ``delta.tool_calls`` items, with their ``index``; only index 0
        unless ``tools.parallel``) and finish reason."""
        stream = state.tool_stream = (state.tool_stream
                                      or ToolCallStream(FORMATS[tools.format]))
        first = len(stream.calls_seen)
        content, calls = stream.feed(text)
        if finish is not None:
            more, last_calls = stream.finish()
            content, calls = content + more, calls + last_calls
        if stream.calls_seen and not content.strip():
            content = ""  # the newlines between calls are not content
        items = [{"index": first + i, **call} for i, call in enumerate(calls)
                 if tools.parallel or first + i == 0]
        return content, items, tools.finish(finish, bool(stream.calls_seen))

    def usage_chunk(self, choices: Sequence[ChoiceState], num_prompt_tokens: int) -> dict[str, Any]:
        """The final ``include_usage`` chunk: ``choices: []`` plus ``usage``."""
        name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = self._envelope(name)
        body["choices"] = []
        body["usage"] = usage_object(choices, num_prompt_tokens)
        return body
