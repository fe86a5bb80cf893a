"""Compile ``StructuredOutputsParams`` into llguidance grammars.

llguidance (https://github.com/guidance-ai/llguidance) because it is a
maintained Rust engine with a self-contained wheel (no torch), computes a
49K-token mask in about a millisecond, reads JSON schemas, regular
expressions, Lark and GBNF grammars, and is one of vLLM's structured-output
backends. xgrammar, the other, needs torch and transformers.

JSON is generated compact apart from one space after ``,`` and ``:``
(``whitespace_flexible: false``): a small model allowed free whitespace
inside a JSON value can emit newlines until ``max_tokens``.
"""

from __future__ import annotations

import json
from functools import lru_cache

import llguidance

from kvserve.core.structured_outputs import StructuredOutputsParams

#: llguidance's JSON options for every schema (see the module docstring).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: The schema of ``response_format: {"type": "json_object"}``: any JSON object.
ANY_OBJECT = {"type": "object"}


class GrammarError(ValueError):
    """A constraint llguidance cannot compile; the message says why."""


def to_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) of ``params``.

    Raises ``GrammarError`` when the constraint cannot be compiled (an
    invalid schema, regex or grammar).
    """
    return _compile(params)


@lru_cache(maxsize=256)
def _compile(params: StructuredOutputsParams) -> str:
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = params.schema() if kind == "json" else ANY_OBJECT
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(params.regex)
        elif kind == "choice":
            grammar = llguidance.grammar_from("choice", json.dumps(list(params.choice)))
        else:
            grammar = llguidance.grammar_from("grammar", params.grammar)
    except (ValueError, TypeError) as exc:
        raise GrammarError(str(exc)) from exc
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(error)
    return grammar


def check(params: StructuredOutputsParams) -> None:
    """Raise ``GrammarError`` (with llguidance's reason) if ``params`` does not compile."""
    to_grammar(params)
