"""Tool calling in the Hermes format: prompt, grammar, parser.

OpenAI's ``tools`` / ``tool_choice`` (https://platform.openai.com/docs/
api-reference/chat/create) on a model whose chat template knows nothing of
tools (the default model's does not): the tools are described in the system
message and the model answers each call as

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

(NousResearch's Hermes format, the common default of vLLM's and SGLang's
tool parsers and of Qwen2.5's template); the parser also reads a JSON list
of calls in one block, SmolLM2's own format. ``tool_choice: "required"`` and a
named function are enforced by a grammar (``tool_grammar``), so that output
always parses; ``auto`` leaves the model free and ``parse_tool_calls``
finds any calls in its text. ``ToolCallStream`` does the same on a stream,
holding back text that may be the start of a call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvserve.constraints.grammar import JSON_OPTIONS
from kvserve.core.structured_outputs import StructuredOutputsParams, closed_objects

OPEN, CLOSE = "<tool_call>", "</tool_call>"

SYSTEM_PROMPT = (
    "You may call one or more functions to assist with the user query. The functions are "
    "described in JSON within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a JSON object with the function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}}\n</tool_call>")


def tool_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The system text that describes ``tools`` (OpenAI ``{"type": "function",
    "function": {...}}`` objects), one JSON object per line."""
    return SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))


def render_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                    ) -> list[dict[str, Any]]:
    """Chat history in a form any ChatML template renders: a ``developer``
    message takes the system role (as in vLLM; OpenAI's newer name for it),
    the tool description joins the system message (or becomes one), an
    assistant's ``tool_calls`` become ``<tool_call>`` blocks in its content,
    and a ``tool`` message becomes a user turn holding ``<tool_response>``."""
    out = []
    for message in messages:
        message = dict(message)
        if message["role"] == "developer":
            message["role"] = "system"
        calls = message.pop("tool_calls", None)
        if calls:
            blocks = [f"{OPEN}\n{json.dumps(_call_body(c))}\n{CLOSE}" for c in calls]
            message["content"] = "\n".join(filter(None, [message.get("content"), *blocks]))
        if message["role"] == "tool":
            message = {"role": "user", "content":
                       f"<tool_response>\n{message.get('content', '')}\n</tool_response>"}
        message.pop("tool_call_id", None)
        out.append(message)
    if tools:
        prompt = tool_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _call_body(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function", {})
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        pass  # shown to the model as the string it was
    return {"name": function.get("name"), "arguments": arguments}


def tool_grammar(tools: list[dict[str, Any]], name: str | None, parallel: bool
                 ) -> StructuredOutputsParams:
    """The grammar of ``tool_choice: "required"`` (``name`` None: one call,
    or if ``parallel`` up to as many as there are tools, each to any of
    ``tools``) or of a named
    function (exactly one call to it): ``<tool_call>`` blocks whose JSON
    matches the function's ``parameters`` schema, and nothing else. The
    bound on parallel calls keeps a small model from repeating calls until
    ``max_tokens``. The params name ``tools`` as their field and each
    chosen function's ``parameters`` as a part (``tools[i].function.
    parameters``), so a schema that does not compile is named."""
    chosen = [(i, t["function"]) for i, t in enumerate(tools)
              if name is None or t["function"]["name"] == name]
    functions = [f for _, f in chosen]
    calls = [{"type": "object", "properties": {
        "name": {"const": f["name"]}, "arguments": _closed(f.get("parameters"))},
        "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = {"anyOf": calls, "x-guidance": JSON_OPTIONS}
    more = len(functions) - 1 if parallel and name is None else 0
    calls_rule = "call" + ' ("\\n" call' * more + ")?" * more
    lark = (f"start: {calls_rule}\n"
            f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
            f"body: %json {json.dumps(schema)}\n")
    parts = tuple((f"tools[{i}].function.parameters", json.dumps(_closed(f.get("parameters"))))
                  for i, f in chosen)
    return StructuredOutputsParams(grammar=lark, field="tools", parts=parts)


def _closed(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function's ``parameters`` schema with ``additionalProperties: false``
    on every object that does not say (``closed_objects``)."""
    return closed_objects(parameters or {"type": "object", "properties": {}})


def new_call_id() -> str:
    """An id for a tool call (OpenAI's ``call_`` prefix)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a complete answer: the OpenAI tool-call
    objects of its well-formed ``<tool_call>`` blocks, and the text around
    them (None when there is none). A block whose JSON does not parse, or
    lacks a name, stays in the content."""
    calls, kept, rest = [], [], text
    while (start := rest.find(OPEN)) >= 0 and (end := rest.find(CLOSE, start)) >= 0:
        found = _to_calls(rest[start + len(OPEN):end])
        if not found:
            kept.append(rest[:end + len(CLOSE)])
        else:
            kept.append(rest[:start])
            calls += found
        rest = rest[end + len(CLOSE):]
    content = ("".join(kept) + rest).strip() if calls else text
    return (content or None), calls


def _to_calls(body: str) -> list[dict[str, Any]]:
    """The calls of one block: a JSON object (Hermes) or a list of them
    (SmolLM2's format); none unless every item is a named call."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return []
    items = data if isinstance(data, list) else [data]
    if not items or not all(isinstance(i, dict) and isinstance(i.get("name"), str)
                            for i in items):
        return []
    return [{"id": new_call_id(), "type": "function", "function": {
        "name": item["name"],
        "arguments": json.dumps(item.get("arguments", item.get("parameters", {})))}}
        for item in items]


@dataclass
class ToolCallStream:
    """Splits a streamed answer into content deltas and complete tool calls.

    ``feed(text)`` returns ``(content, calls)``: the text that is surely
    content, and the calls completed by this delta. Text that may begin a
    ``<tool_call>`` is held until it is known; ``finish()`` returns what is
    left (an unfinished block is content).
    """

    buffer: str = ""
    num_calls: int = 0
    calls_seen: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.buffer += text
        content, calls = [], []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = _partial_open(self.buffer)
                content.append(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            end = self.buffer.find(CLOSE, start)
            content.append(self.buffer[:start])
            if end < 0:
                self.buffer = self.buffer[start:]
                break
            found = _to_calls(self.buffer[start + len(OPEN):end])
            if not found:
                content.append(self.buffer[start:end + len(CLOSE)])
            calls += found
            self.buffer = self.buffer[end + len(CLOSE):]
        self.calls_seen += calls
        return "".join(content), calls

    def finish(self) -> str:
        rest, self.buffer = self.buffer, ""
        return rest


def _partial_open(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a prefix of ``OPEN``."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0
