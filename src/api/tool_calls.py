"""Tool calling: prompt, grammar and parser of each model family's format.

OpenAI's ``tools`` / ``tool_choice`` (https://platform.openai.com/docs/
api-reference/chat/create). ``--tool-call-parser`` (vLLM's names, default
``auto``: the chat template's own markers say which) picks the format the
model answers in (:data:`FORMATS`):

- ``hermes`` (NousResearch's, Qwen 2.5 / Qwen3's templates, vLLM's and
  SGLang's common default)::

      <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

  a JSON list of calls in one block (SmolLM2's own format) parses too;
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3 templates): the answer is a JSON
  object ``{"name": ..., "parameters": {...}}`` (after ``<|python_tag|>``
  or not; several joined by ``;``);
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``;
- ``phi4_mini_json`` (Phi-4-mini): ``functools`` then such a list.

A chat template that knows tools (it mentions them) gets them as its
``tools`` variable and the history as OpenAI sends it (arguments as JSON
objects), as transformers and vLLM render it; a template that does not (the
default model's) gets the tools described in the system message in the
Hermes format, and calls and results in the history as Hermes blocks.
``tool_choice: "required"`` and a named function are enforced by a grammar
of the format (``tool_grammar``), so that output always parses; ``auto``
leaves the model free and ``parse_tool_calls`` finds any calls in its text.
``ToolCallStream`` does the same on a stream, holding back text that may be
the start of a call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvserve.config import TOOL_CALL_PARSERS
from kvserve.constraints.grammar import JSON_OPTIONS
from kvserve.core.structured_outputs import StructuredOutputsParams, closed_objects


@dataclass(frozen=True)
class ToolFormat:
    """How one family writes its calls.

    ``open``: the marker before the calls; ``close``: the marker after one
    block (None: the calls run to the end of the answer); ``args_key``: the
    arguments' key in a call object; ``bare_json``: an answer that starts
    with ``{`` is a call too (Llama 3's JSON calls have no marker); ``list``:
    the calls after ``open`` are one JSON list (else one object per block)."""

    name: str
    open: str
    close: str | None
    args_key: str = "arguments"
    bare_json: bool = False
    list: bool = False


FORMATS = {
    "hermes": ToolFormat("hermes", "<tool_call>", "</tool_call>"),
    "llama3_json": ToolFormat("llama3_json", "<|python_tag|>", None, "parameters",
                              bare_json=True),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", None, list=True),
    "phi4_mini_json": ToolFormat("phi4_mini_json", "functools", None, list=True),
}
#: Template text that names each format (checked in this order); none: Hermes.
_TEMPLATE_MARKERS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"),
                     ("functools", "phi4_mini_json"), ("<|python_tag|>", "llama3_json"),
                     ("ipython", "llama3_json"))


def resolve_format(parser: str, template: str | None) -> ToolFormat:
    """The :class:`ToolFormat` of ``--tool-call-parser parser`` (``auto``: the
    first of :data:`_TEMPLATE_MARKERS` in the chat template, else Hermes).
    Raises ValueError for an unknown parser."""
    if parser == "auto":
        found = next((name for marker, name in _TEMPLATE_MARKERS
                      if template and marker in template), "hermes")
        return FORMATS[found]
    if parser not in FORMATS:
        raise ValueError(f"unknown tool-call parser {parser!r} (known: auto, "
                         f"{', '.join(TOOL_CALL_PARSERS)})")
    return FORMATS[parser]


def template_knows_tools(template: str | None) -> bool:
    """True when the chat template renders a ``tools`` variable (Qwen's,
    Llama 3's, Mistral's do): the tools are given to it, not described by
    kvserve in the system message."""
    return bool(template) and "tools" in template


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


def render_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    native: bool = False) -> list[dict[str, Any]]:
    """Chat history for the chat template. A ``developer`` message takes the
    system role (as in vLLM; OpenAI's newer name for it). ``native`` (the
    template knows tools, :func:`template_knows_tools`; the caller gives it
    ``tools``): the history as OpenAI sends it, each call's ``arguments``
    parsed into an object (transformers' convention). Otherwise, in a form
    any ChatML template renders: the tool description joins the system
    message (or becomes one), an assistant's ``tool_calls`` become
    ``<tool_call>`` blocks in its content, and a ``tool`` message becomes a
    user turn holding ``<tool_response>``."""
    if native:
        return [_native(m) for m in messages]
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


def _native(message: dict[str, Any]) -> dict[str, Any]:
    message = dict(message)
    if message["role"] == "developer":
        message["role"] = "system"
    if message.get("tool_calls"):
        message["tool_calls"] = [{**c, "function": {**c.get("function", {}), **_call_body(c)}}
                                 for c in message["tool_calls"]]
    return message


def _call_body(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function", {})
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        pass  # shown to the model as the string it was
    return {"name": function.get("name"), "arguments": arguments}


def tool_grammar(tools: list[dict[str, Any]], name: str | None, parallel: bool,
                 fmt: ToolFormat | None = None) -> StructuredOutputsParams:
    """The grammar of ``tool_choice: "required"`` (``name`` None: one call,
    or if ``parallel`` up to as many as there are tools, each to any of
    ``tools``) or of a named
    function (exactly one call to it), in format ``fmt`` (default Hermes):
    ``<tool_call>`` blocks (Mistral's and Phi-4-mini's: the marker and one
    JSON list; Llama 3's: one bare JSON call) whose JSON matches the
    function's ``parameters`` schema, and nothing else. The
    bound on parallel calls keeps a small model from repeating calls until
    ``max_tokens``. The params name ``tools`` as their field and each
    chosen function's ``parameters`` as a part (``tools[i].function.
    parameters``), so a schema that does not compile is named."""
    fmt = fmt or FORMATS["hermes"]
    chosen = [(i, t["function"]) for i, t in enumerate(tools)
              if name is None or t["function"]["name"] == name]
    functions = [f for _, f in chosen]
    arguments, defs = _hoist_defs([_closed(f.get("parameters")) for f in functions])
    calls = [{"type": "object", "properties": {
        "name": {"const": f["name"]}, fmt.args_key: args},
        "required": ["name", fmt.args_key], "additionalProperties": False}
        for f, args in zip(functions, arguments)]
    schema = {"anyOf": calls, "x-guidance": JSON_OPTIONS, **({"$defs": defs} if defs else {})}
    more = len(functions) - 1 if parallel and name is None else 0
    if fmt.list:
        listed = {"type": "array", "items": {"anyOf": calls}, "minItems": 1,
                  "maxItems": 1 + more, "x-guidance": JSON_OPTIONS,
                  **({"$defs": defs} if defs else {})}
        lark = f"start: {json.dumps(fmt.open)} body\nbody: %json {json.dumps(listed)}\n"
    elif fmt.close is None:  # Llama 3: one bare JSON call
        lark = f"start: body\nbody: %json {json.dumps(schema)}\n"
    else:
        calls_rule = "call" + ' ("\\n" call' * more + ")?" * more
        lark = (f"start: {calls_rule}\n"
                f'call: "{fmt.open}\\n" body "\\n{fmt.close}"\n'
                f"body: %json {json.dumps(schema)}\n")
    parts = tuple((f"tools[{i}].function.parameters", json.dumps(_closed(f.get("parameters"))))
                  for i, f in chosen)
    return StructuredOutputsParams(grammar=lark, field="tools", parts=parts)


def _hoist_defs(schemas: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``schemas`` (functions' parameters) without their ``$defs`` /
    ``definitions``, and those definitions for the grammar's root schema.

    A function's parameters are nested under its call's ``arguments``, so
    their ``#/$defs/X`` pointers (every nested pydantic model has them) would
    point into the grammar's root, where nothing is: each function's
    definitions move to the root as ``f<i>_X`` and its pointers (also those
    inside the definitions: recursive models) are rewritten to match."""
    hoisted: dict[str, Any] = {}
    out = []
    for i, schema in enumerate(schemas):
        local = {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}
        if not isinstance(schema, dict) or not local:
            out.append(schema)
            continue
        prefix = f"f{i}_"

        def rewrite(node: Any) -> Any:
            if isinstance(node, dict):
                return {k: (_moved_ref(v, prefix) if k == "$ref" and isinstance(v, str)
                            else rewrite(v)) for k, v in node.items()}
            if isinstance(node, list):
                return [rewrite(v) for v in node]
            return node

        out.append(rewrite({k: v for k, v in schema.items() if k not in ("$defs", "definitions")}))
        hoisted.update({prefix + name: rewrite(d) for name, d in local.items()})
    return out, hoisted


def _moved_ref(ref: str, prefix: str) -> str:
    for base in ("#/$defs/", "#/definitions/"):
        if ref.startswith(base):
            return f"#/$defs/{prefix}{ref[len(base):]}"
    return ref


def _closed(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function's ``parameters`` schema with ``additionalProperties: false``
    on every object that does not say (``closed_objects``)."""
    return closed_objects(parameters or {"type": "object", "properties": {}})


def new_call_id() -> str:
    """An id for a tool call (OpenAI's ``call_`` prefix)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str, fmt: ToolFormat | None = None
                     ) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a complete answer in format ``fmt``
    (default Hermes): the OpenAI tool-call objects of its well-formed calls,
    and the text around them (None when there is none). A block whose JSON
    does not parse, or lacks a name, stays in the content."""
    fmt = fmt or FORMATS["hermes"]
    if fmt.close is None:
        return _parse_to_end(text, fmt)
    calls, kept, rest = [], [], text
    while (start := rest.find(fmt.open)) >= 0 and (end := rest.find(fmt.close, start)) >= 0:
        found = _to_calls(rest[start + len(fmt.open):end])
        if not found:
            kept.append(rest[:end + len(fmt.close)])
        else:
            kept.append(rest[:start])
            calls += found
        rest = rest[end + len(fmt.close):]
    content = ("".join(kept) + rest).strip() if calls else text
    return (content or None), calls


def _calls_start(text: str, fmt: ToolFormat) -> tuple[int, int] | None:
    """Where the calls of a run-to-the-end format begin in ``text``: (the
    content's end, the JSON's start), or None. Llama 3's calls may be bare
    JSON at the start of the answer."""
    at = text.find(fmt.open)
    if at >= 0:
        return at, at + len(fmt.open)
    stripped = len(text) - len(text.lstrip())
    if fmt.bare_json and text[stripped:stripped + 1] == "{":
        return 0, stripped
    return None


def _parse_to_end(text: str, fmt: ToolFormat) -> tuple[str | None, list[dict[str, Any]]]:
    """:func:`parse_tool_calls` for formats whose calls run to the end: the
    JSON values after the marker (joined by ``;`` or white space), each a
    call or a list of calls; anything else there leaves the text as content."""
    where = _calls_start(text, fmt)
    if where is None:
        return text, []
    body, pos, items = text[where[1]:], 0, []
    decoder = json.JSONDecoder()
    try:
        while (pos := _skip_separators(body, pos)) < len(body):
            value, pos = decoder.raw_decode(body, pos)
            items += value if isinstance(value, list) else [value]
    except json.JSONDecodeError:
        return text, []
    calls = _calls_of(items)
    if not calls:
        return text, []
    return (text[:where[0]].strip() or None), calls


def _skip_separators(body: str, pos: int) -> int:
    while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
        pos += 1
    return pos


def _to_calls(body: str) -> list[dict[str, Any]]:
    """The calls of one block: a JSON object (Hermes) or a list of them
    (SmolLM2's format); none unless every item is a named call."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return []
    return _calls_of(data if isinstance(data, list) else [data])


def _calls_of(items: list[Any]) -> list[dict[str, Any]]:
    """OpenAI call objects of call dicts (``arguments`` or ``parameters``);
    none unless every item is a named call."""
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
    call is held until it is known; ``finish()`` returns ``(content, calls)``
    of what is left (an unfinished Hermes block is content; a run-to-the-end
    format's calls are parsed there, as a whole answer's are).
    """

    fmt: ToolFormat = field(default_factory=lambda: FORMATS["hermes"])
    buffer: str = ""
    num_calls: int = 0
    calls_seen: list[dict[str, Any]] = field(default_factory=list)
    started: bool = False  # a run-to-the-end format's calls have begun
    emitted: bool = False  # content was given out (a bare JSON call must start the answer)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.buffer += text
        if self.fmt.close is None:
            return self._feed_to_end(), []
        content, calls = [], []
        opener, closer = self.fmt.open, self.fmt.close
        while True:
            start = self.buffer.find(opener)
            if start < 0:
                keep = _partial(self.buffer, opener)
                content.append(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            end = self.buffer.find(closer, start)
            content.append(self.buffer[:start])
            if end < 0:
                self.buffer = self.buffer[start:]
                break
            found = _to_calls(self.buffer[start + len(opener):end])
            if not found:
                content.append(self.buffer[start:end + len(closer)])
            calls += found
            self.buffer = self.buffer[end + len(closer):]
        self.calls_seen += calls
        return "".join(content), calls

    def _feed_to_end(self) -> str:
        """A run-to-the-end format: content up to the marker (or, Llama 3,
        a ``{`` that starts the answer), then everything held for finish."""
        if self.started:
            return ""
        at = self.buffer.find(self.fmt.open)
        if at >= 0:
            content, self.buffer = self.buffer[:at], self.buffer[at:]
            self.started = True
            return content
        if self.fmt.bare_json and not self.emitted:
            stripped = self.buffer.lstrip()
            if stripped.startswith("{"):
                self.started = True
                return ""
            if not stripped:  # white space so far: a bare call may follow
                return ""
        keep = _partial(self.buffer, self.fmt.open)
        cut = len(self.buffer) - keep
        content, self.buffer = self.buffer[:cut], self.buffer[cut:]
        self.emitted |= bool(content)
        return content

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        rest, self.buffer = self.buffer, ""
        if self.fmt.close is None and self.started:
            content, calls = _parse_to_end(rest, self.fmt)
            self.calls_seen += calls
            return content or "", calls
        return rest, []


def _partial(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
