"""OpenAI's Responses API (``POST /v1/responses``) on the chat path.

https://platform.openai.com/docs/api-reference/responses, as vLLM serves it:
a request is turned into the Chat Completions request it means
(:func:`to_chat_body`) and runs through the same validation, template,
tools, structured outputs and engine; the answer is rendered as a
``response`` object (:func:`response_object`) or, streamed, as the typed
events (:class:`EventWriter`: ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` / ``.done``, ``response.function_call_arguments
.delta`` / ``.done``, ``response.output_item.done``, ``response.completed``),
each an SSE ``event:`` line and its JSON with a ``sequence_number``.

Mapping (request -> chat): ``instructions`` -> a system message first;
``input`` a string -> one user message, or items: messages (``input_text`` /
``output_text`` parts), ``function_call`` -> an assistant's ``tool_calls``,
``function_call_output`` -> a ``tool`` message, ``reasoning`` items skipped;
``tools`` (function tools, flat) -> chat's nested ``function`` tools;
``tool_choice`` likewise; ``text.format`` (``json_schema``, ``json_object``)
-> ``response_format``; ``max_output_tokens`` -> ``max_completion_tokens``.
Output: a ``reasoning`` item (with ``--reasoning-parser``), a ``message``
with one ``output_text`` part (when there is text), one ``function_call``
item per call.

``store`` (OpenAI's default: true): the conversation and its answer are kept
in a bounded in-memory store (:class:`ResponseStore`, the last
``STORE_SIZE``), so that ``previous_response_id`` continues it and
``GET /v1/responses/{id}`` returns it; an id not (or no longer) held is a
404. Built-in tools (web search, file search, computer use), ``n`` and
``background`` are refused with a 400 naming the field.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvserve.api.errors import APIError

#: Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``.
STORE_SIZE = 256
#: Request fields read here; any other reaches the chat request as it is
#: (sampling fields: ``temperature``, ``top_p``, ``seed``, ``user``, ...).
_READ = {"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "stream",
         "store", "previous_response_id", "metadata", "reasoning", "include", "truncation",
         "parallel_tool_calls", "model", "background", "stream_options", "conversation"}
#: A chat field's 400 names the Responses field it came from.
CHAT_TO_RESPONSES_PARAM = {"max_completion_tokens": "max_output_tokens", "messages": "input",
                           "response_format": "text", "max_tokens": "max_output_tokens"}


def new_id(prefix: str) -> str:
    """An id of OpenAI's shape: ``resp_<hex>``, ``msg_<hex>``, ``fc_<hex>``."""
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseStore:
    """The last ``size`` stored responses: id -> (the chat messages that led
    to it, its response object, its output as chat messages)."""

    def __init__(self, size: int = STORE_SIZE) -> None:
        self.size = size
        self._items: OrderedDict[str, tuple[list[dict], dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, messages: list[dict], answer: list[dict]) -> None:
        self._items[response["id"]] = (messages, response, answer)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def response(self, response_id: str, param: str = "response_id") -> dict:
        """The stored response; APIError 404 naming ``param`` when it is not held."""
        if response_id not in self._items:
            raise APIError(404, f"No response with id {response_id!r} is stored here (the "
                                f"last {self.size} with store true are kept, in memory).",
                           param=param, code="not_found")
        return self._items[response_id][1]

    def conversation(self, response_id: str) -> list[dict]:
        """The chat messages of a stored response and its answer; 404 as
        :meth:`response`, naming ``previous_response_id``."""
        self.response(response_id, "previous_response_id")
        messages, _, answer = self._items[response_id]
        return [*messages, *answer]


def _text_of(content: Any, where: str) -> str:
    """A message's text: a string, or its ``input_text`` / ``output_text`` parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in (
                    "input_text", "output_text", "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(400, f"{where}.content[{i}]: parts of type {kind!r} are not "
                                    "supported (text only)", param="input")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise APIError(400, f"{where}.content must be a string or a list of text parts",
                   param="input")


def input_messages(data: dict[str, Any], store: ResponseStore) -> list[dict[str, Any]]:
    """The chat messages of a Responses request: the previous response's
    conversation (``previous_response_id``), ``instructions`` as a system
    message, then ``input``. APIError 400 naming ``input`` for an item
    kvserve does not read, 404 for an unknown previous response."""
    messages: list[dict[str, Any]] = []
    if data.get("previous_response_id"):
        messages += [m for m in store.conversation(str(data["previous_response_id"]))
                     if m["role"] != "system"]
    if data.get("instructions"):
        messages.insert(0, {"role": "system", "content": str(data["instructions"])})
    items = data.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError(400, "input must be a string or a non-empty list of items", param="input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer",
                               param="input")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id") or item.get("id") or new_id("call")),
                    "type": "function", "function": {"name": str(item.get("name", "")),
                                                     "arguments": str(item.get("arguments", ""))}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            continue  # a previous thought: not shown to the model again
        else:
            raise APIError(400, f"{where}: items of type {kind!r} are not supported (message, "
                                "function_call, function_call_output)", param="input")
    return messages


def to_chat_body(data: dict[str, Any], store: ResponseStore) -> tuple[dict[str, Any], list[dict]]:
    """The Chat Completions body a Responses request means, and its messages.

    Raises APIError 400 naming the field for what is not supported: tools
    other than functions, ``n`` other than 1, ``background``."""
    if data.get("background"):
        raise APIError(400, "background: background responses are not supported",
                       param="background")
    if data.get("conversation"):
        raise APIError(400, "conversation: conversations are not supported here; continue one "
                            "with previous_response_id", param="conversation")
    if data.get("n", 1) != 1:
        raise APIError(400, "n: a response has one output", param="n")
    messages = input_messages(data, store)
    body: dict[str, Any] = {k: v for k, v in data.items() if k not in _READ}
    body["messages"] = messages
    if data.get("model") is not None:
        body["model"] = data["model"]
    if data.get("max_output_tokens") is not None:
        body["max_completion_tokens"] = data["max_output_tokens"]
    if data.get("parallel_tool_calls") is not None:
        body["parallel_tool_calls"] = data["parallel_tool_calls"]
    tools = data.get("tools") or []
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list", param="tools")
    chat_tools = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(400, f"tools[{i}]: tools of type {kind!r} are not supported "
                                "(function tools only)", param="tools")
        chat_tools.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}})
    if chat_tools:
        body["tools"] = chat_tools
    choice = data.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or "name" not in choice:
            raise APIError(400, "tool_choice: a function, named, or auto / none / required",
                           param="tool_choice")
        body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        body["tool_choice"] = choice
    fmt = (data.get("text") or {}).get("format") if isinstance(data.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "text.format: a json_schema format needs its schema (an object)",
                           param="text")
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "output"), "schema": fmt.get("schema", {}),
            "strict": fmt.get("strict", False)}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise APIError(400, f"text.format: type {fmt.get('type')!r} is not supported",
                       param="text")
    body["stream"] = bool(data.get("stream"))
    return body, messages


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Chat ``usage`` as the Responses API names it."""
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens":
                                     usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def response_shell(response_id: str, data: dict[str, Any], model: str, created: int,
           status: str) -> dict[str, Any]:
    """The fields of a ``response`` object that echo the request."""
    return {"id": response_id, "object": "response", "created_at": created, "status": status,
            "error": None, "incomplete_details": None, "model": model, "output": [],
            "instructions": data.get("instructions"),
            "max_output_tokens": data.get("max_output_tokens"),
            "temperature": data.get("temperature"), "top_p": data.get("top_p"),
            "tools": data.get("tools") or [], "tool_choice": data.get("tool_choice") or "auto",
            "parallel_tool_calls": data.get("parallel_tool_calls", True),
            "previous_response_id": data.get("previous_response_id"),
            "text": data.get("text") or {"format": {"type": "text"}},
            "metadata": data.get("metadata") or {}, "store": data.get("store", True),
            "usage": None}


def _message_item(text: str, item_id: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call: dict[str, Any], item_id: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": "completed"}


def _finish(response: dict[str, Any], finish_reason: str | None) -> None:
    """``status`` / ``incomplete_details`` of a finished response (and of its
    message item: ``incomplete`` when the limit cut it, as OpenAI marks it)."""
    if finish_reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
        for item in response["output"]:
            if item.get("type") == "message":
                item["status"] = "incomplete"
    else:
        response["status"] = "completed"


def response_object(chat: dict[str, Any], data: dict[str, Any], response_id: str,
                    model: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The ``response`` object of a finished chat answer ``chat`` (a
    ``chat.completion``), and the answer as chat messages (for the store)."""
    [choice] = chat["choices"]
    message = choice["message"]
    response = response_shell(response_id, data, model, chat["created"], "completed")
    output = response["output"]
    if message.get("reasoning_content"):
        output.append({"type": "reasoning", "id": new_id("rs"), "summary": [],
                       "content": [{"type": "reasoning_text",
                                    "text": message["reasoning_content"]}]})
    if message.get("content"):
        output.append(_message_item(message["content"], new_id("msg")))
    for call in message.get("tool_calls") or ():
        output.append(_call_item(call, new_id("fc")))
    _finish(response, choice["finish_reason"])
    response["usage"] = _usage(chat["usage"])
    answer = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        answer["tool_calls"] = message["tool_calls"]
    return response, [answer]


@dataclass
class EventWriter:
    """Turns a streamed chat answer (its chunks' deltas) into the Responses
    API's typed events, in order; :meth:`done` ends with
    ``response.completed`` holding the whole response."""

    response: dict[str, Any]
    sequence: int = 0
    text: list[str] = field(default_factory=list)
    message_id: str | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return (f"event: {kind}\ndata: "
                f"{json.dumps(body, separators=(',', ':'), allow_nan=False)}\n\n").encode()

    def start(self) -> list[bytes]:
        return [self.event("response.created", response=dict(self.response)),
                self.event("response.in_progress", response=dict(self.response))]

    def delta(self, delta: dict[str, Any]) -> list[bytes]:
        """The events of one chat delta (text, complete tool calls)."""
        out = []
        content = delta.get("content")
        if content:
            if self.message_id is None:
                self.message_id = new_id("msg")
                out.append(self.event("response.output_item.added", output_index=0,
                                      item=_message_item("", self.message_id, "in_progress")
                                      | {"content": []}))
                out.append(self.event("response.content_part.added", item_id=self.message_id,
                                      output_index=0, content_index=0,
                                      part={"type": "output_text", "text": "",
                                            "annotations": []}))
            self.text.append(content)
            out.append(self.event("response.output_text.delta", item_id=self.message_id,
                                  output_index=0, content_index=0, delta=content,
                                  logprobs=[]))
        for call in delta.get("tool_calls") or ():
            out += self._call(call)
        return out

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        index = len(self.calls) + (1 if self.message_id is not None else 0)
        item = _call_item(call, new_id("fc"))
        self.calls.append(item)
        arguments = item["arguments"]
        return [self.event("response.output_item.added", output_index=index,
                           item=item | {"arguments": "", "status": "in_progress"}),
                self.event("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=index, delta=arguments),
                self.event("response.function_call_arguments.done", item_id=item["id"],
                           output_index=index, arguments=arguments),
                self.event("response.output_item.done", output_index=index, item=item)]

    def done(self, finish_reason: str | None, usage: dict[str, Any]) -> list[bytes]:
        """The closing events: the message's ``done`` events, then
        ``response.completed`` (or ``response.incomplete``)."""
        out = []
        text = "".join(self.text)
        output = []
        if self.message_id is not None:
            part = {"type": "output_text", "text": text, "annotations": []}
            out += [self.event("response.output_text.done", item_id=self.message_id,
                               output_index=0, content_index=0, text=text, logprobs=[]),
                    self.event("response.content_part.done", item_id=self.message_id,
                               output_index=0, content_index=0, part=part),
                    self.event("response.output_item.done", output_index=0,
                               item=_message_item(text, self.message_id))]
            output.append(_message_item(text, self.message_id))
        output += self.calls
        self.response["output"] = output
        self.response["usage"] = _usage(usage)
        _finish(self.response, finish_reason)
        kind = ("response.incomplete" if self.response["status"] == "incomplete"
                else "response.completed")
        out.append(self.event(kind, response=self.response))
        return out


async def chat_chunks(events: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """The chunks (dicts) of a chat SSE body (``data: {...}`` events; ``[DONE]`` ends it)."""
    try:
        async for data in events:
            for line in data.decode("utf-8").split("\n"):
                if line.startswith("data: {"):
                    yield json.loads(line[len("data: "):])
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


async def stream_events(writer: EventWriter, chunks: AsyncIterator[dict[str, Any]],
                        on_done: Any) -> AsyncIterator[bytes]:
    """The Responses events of a stream of chat chunks (dicts, as the chat
    renderer makes them; an ``error`` dict ends it with ``error``);
    ``on_done(response, answer_messages)`` once it completed."""
    for data in writer.start():
        yield data
    finish, usage = None, None
    try:
        async for chunk in chunks:
            if "error" in chunk:
                error = chunk["error"]
                yield writer.event("error", message=error.get("message", ""),
                                   code=error.get("code"), param=error.get("param"))
                return
            for choice in chunk.get("choices") or ():
                for data in writer.delta(choice.get("delta") or {}):
                    yield data
                finish = choice.get("finish_reason") or finish
            if chunk.get("usage"):
                usage = chunk["usage"]
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
    usage = usage or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for data in writer.done(finish, usage):
        yield data
    answer = {"role": "assistant", "content": "".join(writer.text)}
    if writer.calls:
        answer["tool_calls"] = [{"id": c["call_id"], "type": "function",
                                 "function": {"name": c["name"], "arguments": c["arguments"]}}
                                for c in writer.calls]
    on_done(writer.response, [answer])


def created_now() -> int:
    """Seconds since the epoch (a response's ``created_at``)."""
    return int(time.time())
