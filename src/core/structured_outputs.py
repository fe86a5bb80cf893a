"""What a request's output must match: vLLM's ``StructuredOutputsParams``.

Exactly one constraint per request: a JSON schema (``json``), any JSON
object (``json_object``), a regular expression (``regex``), one of a list
of strings (``choice``) or a context-free grammar (``grammar``, Lark as
llguidance reads it, or GBNF as llama.cpp writes it). The API builds it from
OpenAI's ``response_format`` and vLLM's ``guided_*`` fields; the worker turns
it into a token mask (``kvserve.structured``). Pure data: no grammar engine
is imported here.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint; ``ValueError`` unless exactly one is set.

    ``json`` is the schema serialized (keys in the client's order, which is
    the order the properties are generated in; a string keeps the params
    hashable); ``schema()`` parses it.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

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
