"""What a request's output must match: vLLM's ``StructuredOutputsParams``.

Exactly one constraint per request: a JSON schema (``json``), any JSON
object (``json_object``), a regular expression (``regex``), one of a list
of strings (``choice``) or a context-free grammar (``grammar``, Lark as
llguidance reads it, or GBNF as llama.cpp writes it). The API builds it from
OpenAI's ``response_format`` and vLLM's ``guided_*`` fields; the worker turns
it into a token mask (``kvserve.constraints``). Pure data: no grammar engine
is imported here.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, replace
from dataclasses import field as dc_field
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint; ``ValueError`` unless exactly one is set.

    ``json`` is the schema serialized (keys in the client's order, which is
    the order the properties are generated in; a string keeps the params
    hashable); ``schema()`` parses it.

    Three fields describe the constraint without being part of it (they take
    no part in equality or hashing, so equal constraints share one compiled
    form):

    - ``field``: the request field that set it (``guided_json``,
      ``response_format``, ``tools``...), named by a 400 about it;
    - ``parts``: ``(param, schema JSON)`` of the schemas a grammar embeds
      (a tool's ``parameters``: ``tools[1].function.parameters``), so that
      an error names the one at fault;
    - ``compiled``: the engine's compiled form (a
      ``kvserve.constraints.compiler.CompiledConstraint``), set before the
      request is scheduled; never pickled (it lives in one process).
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    field: str | None = dc_field(default=None, compare=False)
    parts: tuple[tuple[str, str], ...] = dc_field(default=(), compare=False)
    compiled: Any = dc_field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        set_ = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"exactly one structured-output constraint is allowed, got {set_}")
        if self.choice is not None and (not self.choice or
                                        not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("guided_choice must be a non-empty list of strings")

    @classmethod
    def from_schema(cls, schema: dict[str, Any] | str) -> StructuredOutputsParams:
        """From a JSON schema (a dict, or its JSON text); ``ValueError`` if it is not an object."""
        if isinstance(schema, str):
            try:
                schema = _json.loads(schema)
            except _json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from exc
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be a JSON object")
        return cls(json=_json.dumps(schema))

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without ``compiled`` (a handle to this process's compiler)."""
        return {**self.__dict__, "compiled": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def named(self, field_: str | None) -> StructuredOutputsParams:
        """The same constraint, set by the request field ``field_``."""
        return replace(self, field=field_)

    @property
    def size_bytes(self) -> int:
        """The constraint's size in UTF-8 bytes: the schema's JSON, the regex,
        the grammar, or the choices (each with 3 bytes of separators, as in
        a JSON list); 0 for ``json_object``. What the engine's size limit
        counts."""
        if self.choice is not None:
            return sum(len(option.encode()) + 3 for option in self.choice)
        text = self.json if self.json is not None else self.regex or self.grammar or ""
        return len(text.encode())

    @property
    def kind(self) -> str:
        """Which constraint: one of ``KINDS``."""
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema as a dict (None unless ``kind == "json"``)."""
        return None if self.json is None else _json.loads(self.json)


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema
    that does not say (a copy). OpenAI's strict mode requires it of every
    object; without it a small model invents keys ("description")."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed_objects(value) for key, value in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


#: Where a constraint refusal's message turns to the compiler's own detail,
#: which quotes the request's regex, grammar or schema (``kvserve.
#: constraints.compiler``'s ``ConstraintError`` messages).
_DETAIL_MARKS = (" cannot be compiled: ", " schema is invalid: ")
#: What stands in a log line for the detail cut off.
DETAIL_NOT_LOGGED = "[the compiler's detail quotes the request: not logged]"


def log_safe(message: str | None) -> str | None:
    """``message`` (a refusal, as the client gets it) for a log line: a
    constraint refusal's detail, which quotes the user's own constraint
    text, is cut off (the client's 400 keeps it; ``--log-prompts`` is the
    only switch that logs request text). Other messages pass unchanged."""
    if not message:
        return message
    for mark in _DETAIL_MARKS:
        at = message.find(mark)
        if at >= 0:
            return message[:at + len(mark)] + DETAIL_NOT_LOGGED
    return message
