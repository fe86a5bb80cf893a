"""OpenAI request models (pydantic v2); the response objects and stream
chunks are ``kvserve.api.rendering``'s.

Formats follow the OpenAI API reference:

- Chat: https://platform.openai.com/docs/api-reference/chat/create.
- Completions (legacy): https://platform.openai.com/docs/api-reference/completions.

Requests are validated in strict mode (no ``"1"`` -> ``1`` coercion), so a
wrong type is a 400 that names the field. A JSON ``null`` for an optional
field means "unset" (its default), as OpenAI and vLLM read it. Value ranges
are checked once, by ``SamplingParams``. Sampling fields a request omits
take the server's generation defaults (``with_defaults``: the checkpoint's
``generation_config.json``, vLLM's ``--generation-config``). Unknown fields are ignored, as vLLM
does; a field OpenAI defines whose answer would differ (``best_of``) is
refused rather than ignored.
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvserve.api.tool_calls import ToolFormat, render_messages, tool_grammar
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.structured_outputs import StructuredOutputsParams, closed_objects
from kvserve.model.generation_config import GenerationDefaults

TokenText = Callable[[int], str]
TokenBytes = Callable[[int], bytes]


class _Model(BaseModel):
    """A request object: strict types, unknown fields ignored (as OpenAI and
    vLLM ignore them), and ``null`` for an optional field whose type has no
    None taken as unset: the OpenAI reference marks such fields "Optional,
    defaults to ..." and its clients send ``null`` for them (vLLM's
    ``Optional`` fields read it the same way). A required field given
    ``null`` stays an error naming it; a field typed ``X | None`` keeps
    ``null`` as its value (``max_tokens: null``: no limit)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        unset = _unset_by_null(cls)
        return {key: value for key, value in data.items() if value is not None or key not in unset}


@functools.cache
def _unset_by_null(model: type[BaseModel]) -> frozenset[str]:
    """The JSON keys (aliases: ``schema``, ``json``) of ``model``'s optional
    fields whose type does not admit None: a ``null`` there is left out."""
    return frozenset(info.alias or name for name, info in model.model_fields.items()
                     if not info.is_required() and not _admits_none(info.annotation))


def _admits_none(annotation: Any) -> bool:
    """True when a field typed ``annotation`` validates ``null`` itself."""
    if annotation in (Any, None, type(None)):
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_admits_none(arg) for arg in typing.get_args(annotation))
    return origin is Literal and None in typing.get_args(annotation)


class TextPart(_Model):
    """A content part ``{"type": "text", "text": ...}`` (only text is supported)."""

    type: Literal["text"]
    text: str


class FunctionCall(_Model):
    """``tool_calls[].function`` of an assistant message: name and JSON arguments."""

    name: str
    arguments: str


class ToolCall(_Model):
    """One ``tool_calls`` item of an assistant message in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    """One chat message: ``role`` and ``content`` (a string or text parts);
    an assistant's ``tool_calls`` and a tool result's ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The message as the chat template expects it (content as one string).

        Text parts are joined with newlines, as vLLM does.
        """
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(_Model):
    """``tools[].function``: a name (``^[a-zA-Z0-9_-]{1,64}$``, OpenAI's
    rule), a description and a JSON schema of its ``parameters``."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Model):
    """One ``tools`` item: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Model):
    """``stream_options`` (only with ``stream: true``, as OpenAI and vLLM
    require): ``include_usage`` adds one final usage-only chunk;
    ``continuous_usage_stats`` (vLLM) also puts the usage so far in every
    chunk (with ``include_usage`` only, as in vLLM)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Model):
    """``response_format.json_schema``: ``{"name", "schema", "strict"}`` (OpenAI)."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    """``response_format`` (OpenAI): ``text``, ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Model):
    """vLLM's ``structured_outputs`` request field: one of its keys."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _CommonRequest(_Model):
    """Fields shared by chat and completions (OpenAI's plus vLLM's extras).

    Structured outputs: OpenAI's ``response_format`` (``json_object``,
    ``json_schema``), vLLM's ``guided_json`` / ``guided_regex`` /
    ``guided_choice`` / ``guided_grammar`` and its ``structured_outputs``
    object; at most one of them.
    """

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    user: str | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsField | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's output constraint, or None; ``ValueError`` whose
        message starts with the field's name when it is malformed or when
        several fields set one."""
        found = [(name, params) for name, params in self._constraints() if params is not None]
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise ValueError(f"{found[1][0]}: only one structured-output constraint is allowed "
                             f"per request, got {names}")
        return found[0][1].named(found[0][0]) if found else None

    def structured_outputs_field(self) -> str | None:
        """The name of the field that set the constraint (for a 400's ``param``)."""
        return next((name for name, params in self._constraints() if params is not None), None)

    def _constraints(self) -> list[tuple[str, StructuredOutputsParams | None]]:
        def build(name: str, make: Callable[[], StructuredOutputsParams | None]):
            try:
                return name, make()
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from exc

        return [
            build("response_format", lambda: _from_response_format(self.response_format)),
            build("guided_json", lambda: None if self.guided_json is None
                  else StructuredOutputsParams.from_schema(self.guided_json)),
            build("guided_regex", lambda: None if self.guided_regex is None
                  else StructuredOutputsParams(regex=self.guided_regex)),
            build("guided_choice", lambda: None if self.guided_choice is None
                  else StructuredOutputsParams(choice=tuple(self.guided_choice))),
            build("guided_grammar", lambda: None if self.guided_grammar is None
                  else StructuredOutputsParams(grammar=self.guided_grammar)),
            build("structured_outputs", lambda: _from_vllm_field(self.structured_outputs)),
        ]

    @property
    def include_usage(self) -> bool:
        """True when the stream must end with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """True when every chunk carries the usage so far (vLLM's option)."""
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)

    def _sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``SamplingParams``; unset fields keep its
        defaults. ``ValueError`` for ``stream_options`` without ``stream``."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        kwargs: dict[str, Any] = {
            "n": self.n, "seed": self.seed, "min_tokens": self.min_tokens,
            "stop": self.stop or (), "stop_token_ids": self.stop_token_ids or (),
            "ignore_eos": self.ignore_eos, "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logit_bias": _logit_bias(self.logit_bias),
            "structured_outputs": self.structured_outputs_params(),
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        return kwargs


def with_defaults(kwargs: dict[str, Any], defaults: GenerationDefaults | None) -> SamplingParams:
    """``SamplingParams(**kwargs)`` with the server's generation defaults
    (``--generation-config``: ``kvserve.model.generation_config``) in the
    fields the request left out: the one place both endpoints apply them.

    ``kwargs`` holds the request's sampling fields, the omitted ones absent
    (``_sampling_kwargs``) and ``max_tokens`` None when unset. A field the
    request sent always wins (``temperature: 0`` stays greedy), except that
    a ``--generation-config`` folder's ``max_new_tokens`` caps ``max_tokens``
    (vLLM's rule). ``defaults`` None: ``SamplingParams``' own defaults.
    Raises ``ValueError`` naming the field for a bad value.
    """
    return SamplingParams(**(kwargs if defaults is None else defaults.apply(kwargs)))


def _from_response_format(fmt: ResponseFormat | None) -> StructuredOutputsParams | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ValueError("type json_schema needs json_schema.schema")
    schema = fmt.json_schema.schema_
    return StructuredOutputsParams.from_schema(
        closed_objects(schema) if fmt.json_schema.strict else schema)


def _from_vllm_field(field_: StructuredOutputsField | None) -> StructuredOutputsParams | None:
    if field_ is None:
        return None
    kwargs: dict[str, Any] = {}
    if field_.json_ is not None:
        return StructuredOutputsParams.from_schema(field_.json_)
    if field_.json_object:
        kwargs["json_object"] = True
    for name in ("regex", "grammar"):
        if getattr(field_, name) is not None:
            kwargs[name] = getattr(field_, name)
    if field_.choice is not None:
        kwargs["choice"] = tuple(field_.choice)
    return StructuredOutputsParams(**kwargs)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings); make them ints."""
    if not bias:
        return None
    try:
        return {int(key): value for key, value in bias.items()}
    except ValueError as exc:
        raise ValueError("logit_bias keys must be token ids (integers)") from exc


#: Chat-template variables the renderer sets (``Tokenizer.apply_chat_template``).
RESERVED_TEMPLATE_NAMES = ("messages", "add_generation_prompt", "bos_token", "eos_token",
                           "raise_exception", "tools")


class ChatCompletionRequest(_CommonRequest):
    """Body of ``POST /v1/chat/completions``.

    Tools (``kvserve.api.tool_calls``): ``tools``, ``tool_choice`` (``none``,
    ``auto``, the default when tools are given, ``required`` or a named
    function) and ``parallel_tool_calls``.
    ``chat_template_kwargs`` (vLLM's): more variables for the chat template,
    e.g. Qwen3's ``{"enable_thinking": false}``; the names the renderer sets
    itself (:data:`RESERVED_TEMPLATE_NAMES`) are refused.
    ``add_generation_prompt`` (default true) and ``continue_final_message``
    (vLLM's assistant prefill: the last, assistant, message is continued;
    only with ``add_generation_prompt`` false, as vLLM requires).
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check_template_fields(self) -> None:
        """Raise ``ValueError`` (its message starts with the field's name) for
        ``chat_template_kwargs`` naming what the renderer sets, or an
        assistant prefill that cannot be (vLLM's rules)."""
        for name in self.chat_template_kwargs or ():
            if name in RESERVED_TEMPLATE_NAMES or not name.isidentifier():
                raise ValueError(f"chat_template_kwargs: {name!r} cannot be set (the renderer "
                                 f"sets {', '.join(RESERVED_TEMPLATE_NAMES)})")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be true with add_generation_prompt "
                             "true (vLLM's rule: set add_generation_prompt to false)")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message: the last message must be the "
                             "assistant's text to continue")

    @property
    def tools_active(self) -> bool:
        """True when the model is told of tools and its answer is parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_tool(self) -> tuple[bool, str | None]:
        """``(forced, name)``: whether a grammar must make the answer tool
        calls (``required``, or a named function: ``name``); ``ValueError``
        naming ``tool_choice`` for a choice the tools cannot satisfy."""
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return False, None
        if not self.tools:
            raise ValueError("tool_choice: it needs tools")
        if choice == "required":
            return True, None
        names = [t.function.name for t in self.tools]
        if choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool is named {choice.function.name!r} "
                             f"(tools: {names})")
        return True, choice.function.name

    def sampling_params(self, defaults: GenerationDefaults | None = None,
                        tool_format: ToolFormat | None = None) -> SamplingParams:
        """Build ``SamplingParams``; raises ``ValueError`` for bad values.

        ``max_completion_tokens`` wins over the deprecated ``max_tokens``;
        unset means the ``defaults``' ``max_tokens``, else "up to the
        context length". ``top_logprobs`` needs ``logprobs: true`` (as
        OpenAI requires). ``defaults``: ``with_defaults``. ``tool_format``:
        the format a forced tool choice's grammar writes (default Hermes).
        """
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        kwargs = self._sampling_kwargs()
        forced, name = self.forced_tool()
        if forced:
            if kwargs["structured_outputs"] is not None:
                raise ValueError(f"tool_choice: {self.tool_choice if name is None else name!r} "
                                 f"cannot be combined with {self.structured_outputs_field()}")
            kwargs["structured_outputs"] = tool_grammar(
                [t.model_dump(exclude_none=True) for t in self.tools or ()], name,
                self.parallel_tool_calls, tool_format)
        return with_defaults(dict(kwargs, max_tokens=max_tokens, logprobs=logprobs), defaults)

    def tool_reply(self, tool_format: str = "hermes") -> ToolReply | None:
        """How the answer's tool calls are returned, or None when tools are
        not active (no tools, or ``tool_choice: "none"``); ``tool_format``:
        the name of the format they are parsed in (``tool_calls.FORMATS``)."""
        if not self.tools_active:
            return None
        forced, name = self.forced_tool()
        return ToolReply(forced=forced, named=name is not None,
                         parallel=self.parallel_tool_calls, format=tool_format)

    def active_tools(self) -> list[dict[str, Any]] | None:
        """The tools as JSON objects when they are active, else None."""
        return ([t.model_dump(exclude_none=True) for t in self.tools or ()]
                if self.tools_active else None)

    def template_messages(self, native: bool = False) -> list[dict[str, Any]]:
        """The messages as the chat template gets them (``kvserve.api.tool_calls.
        render_messages``): ``native``, the template knows tools and gets
        them as its ``tools`` variable; else tool descriptions, calls and
        results in the Hermes format."""
        return render_messages([m.to_dict() for m in self.messages],
                               None if native else self.active_tools(), native)


class CompletionRequest(_CommonRequest):
    """Body of ``POST /v1/completions``
    (https://platform.openai.com/docs/api-reference/completions/create).

    ``prompt`` is a string, a list holding one string, a list of token ids,
    or a list holding one list of token ids. A batch of several prompts
    (which OpenAI and vLLM answer with choices for each) is refused with a
    400 naming ``prompt``: send one request per prompt, they are batched by
    the engine anyway. ``max_tokens`` defaults to 16 as in OpenAI's
    reference. ``echo`` puts the prompt before the completion in ``text``;
    with ``logprobs`` the prompt's tokens come first in ``logprobs``, the
    first one with a null logprob (nothing predicts it). ``parse_special``
    (llama.cpp's name, a kvserve extension, default false): special-token
    strings in a text prompt (``<|im_start|>``) become control tokens;
    without it they are text, so a prompt cannot forge a chat turn.
    ``best_of`` (``best_of`` samples, the ``n`` of highest mean log
    probability returned) is not implemented: only ``best_of`` equal to
    ``n`` (all samples returned) or null is taken (``check_best_of``).
    """

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    parse_special: bool = False
    best_of: int | None = None

    def prompt_input(self) -> tuple[str | None, tuple[int, ...] | None]:
        """``(prompt_text, prompt_token_ids)``, exactly one set; ``ValueError``
        names ``prompt`` when it is a batch or empty."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("prompt: batched prompts are not supported; "
                                 "send one prompt per request")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt, None
        if not prompt:
            raise ValueError("prompt must not be empty")
        return None, tuple(prompt)

    def check_best_of(self) -> None:
        """``ValueError`` naming ``best_of`` unless it is null or equals ``n``.

        OpenAI's legacy completions reference: "``best_of`` must be greater
        than ``n``" (ranked server-side, only ``n`` returned; equal to ``n``
        it changes nothing). kvserve does not rank samples, as vLLM V1
        dropped ``best_of``: a request for it is refused rather than
        quietly answered with ``n`` unranked samples.
        """
        if self.best_of is None or self.best_of == self.n:
            return
        if self.best_of < self.n:
            raise ValueError(f"best_of must be greater than or equal to n, got best_of="
                             f"{self.best_of} and n={self.n}")
        raise ValueError(
            f"best_of is not supported (got {self.best_of} with n={self.n}): kvserve does not "
            "implement best_of (vLLM V1 removed it too). Request `n` completions with "
            "`logprobs` and pick the best one client-side (e.g. by the mean of "
            "token_logprobs).")

    def sampling_params(self, defaults: GenerationDefaults | None = None) -> SamplingParams:
        """Build ``SamplingParams``; raises ``ValueError`` for bad values
        (``best_of``: ``check_best_of``).

        ``echo`` with ``logprobs`` asks the engine for prompt logprobs too.
        ``defaults``: ``with_defaults``; an omitted ``max_tokens`` is
        OpenAI's 16, so only ``max_tokens: null`` takes the default's (as in
        vLLM, whose completions ``max_tokens`` defaults to 16 too).
        """
        self.check_best_of()
        prompt_logprobs = self.logprobs if self.echo else None
        return with_defaults(dict(self._sampling_kwargs(), max_tokens=self.max_tokens,
                                  logprobs=self.logprobs, prompt_logprobs=prompt_logprobs),
                             defaults)


class TokenizeRequest(_Model):
    """Body of ``POST /tokenize`` (vLLM's extension): either ``prompt`` (text,
    with ``add_special_tokens``, default true, and ``parse_special``, default
    false, as ``/v1/completions`` takes them) or chat ``messages`` (rendered
    with the chat template, ``add_generation_prompt`` default true)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    parse_special: bool = False
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Model):
    """Body of ``POST /detokenize`` (vLLM's extension): ``tokens`` -> ``prompt``."""

    model: str | None = None
    tokens: list[int]


def _request_models(base: type[_Model] = _Model) -> list[type[_Model]]:
    return [m for sub in base.__subclasses__() for m in (sub, *_request_models(sub))]


#: Every field name of a request object (aliases as sent), for ``param`` paths.
_FIELD_NAMES: frozenset[str] = frozenset(
    info.alias or name for model in _request_models() for name, info in model.model_fields.items())


def validation_error_param(exc: ValidationError) -> tuple[str | None, str]:
    """``(param, message)`` for a pydantic ``ValidationError``.

    ``param`` is the field path such as ``messages.0.content``; pydantic's
    union-member tags (``str``, ``list[int]``) and dict keys are dropped. Of
    several errors (one per union member) the most specific path wins.
    """
    candidates = [(_field_path(error["loc"]), error)
                  for error in exc.errors(include_url=False)]
    param, error = max(candidates, key=lambda item: len(item[0].split(".")) if item[0] else 0)
    if error["type"] == "missing":
        return param, f"Missing required parameter: '{param}'."
    return param, f"{param}: {error['msg']}" if param else error["msg"]


def _field_path(loc: Sequence[int | str]) -> str | None:
    parts: list[str] = []
    for part in loc:
        if isinstance(part, int) or part in _FIELD_NAMES:
            parts.append(str(part))
    return ".".join(parts) or None


def value_error_param(message: str, fields: Sequence[str]) -> str | None:
    """Guess the request field a ``SamplingParams`` error is about.

    Its messages start with the field's name (``"top_p must be in ..."``).
    """
    head = message.split(" ", 1)[0].rstrip(":")
    return head if head in fields else None


@dataclass(frozen=True)
class ToolReply:
    """How a chat answer's tool calls come back (``tool_choice`` and
    ``parallel_tool_calls`` of the request; OpenAI chat reference, and vLLM's
    ``maybe_filter_parallel_tool_calls`` and ``resolve_finish_reason``).

    ``forced`` (``required`` or a named function): a grammar made the answer
    nothing but calls, so it has no content. ``named``: a named function;
    the answer finishes with ``stop``, as OpenAI and vLLM report it, where
    ``auto`` and ``required`` finish with ``tool_calls``. ``parallel`` false:
    only the first complete call is returned (streamed: only ``index`` 0),
    later ones are dropped and the content stays as it is.
    """

    forced: bool = False
    named: bool = False
    parallel: bool = True
    format: str = "hermes"  # ``tool_calls.FORMATS`` key: how the answer writes calls

    def finish(self, finish: str | None, called: bool) -> str | None:
        """The choice's ``finish_reason``: a ``stop`` after calls becomes
        ``tool_calls``, except for a named function."""
        return "tool_calls" if called and finish == "stop" and not self.named else finish
