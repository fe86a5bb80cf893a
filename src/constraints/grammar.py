"""Compile ``StructuredOutputsParams`` into llguidance grammars and matchers.

llguidance (https://github.com/guidance-ai/llguidance) because it is a
maintained Rust engine with a self-contained wheel (no torch), computes a
49K-token mask in about a millisecond, reads JSON schemas, regular
expressions, Lark and GBNF grammars, and is one of vLLM's structured-output
backends. xgrammar, the other, needs torch and transformers.

JSON is generated compact apart from one space after ``,`` and ``:``
(``whitespace_flexible: false``): a small model allowed free whitespace
inside a JSON value can emit newlines until ``max_tokens``.

These functions are the work itself, with no bound on its cost: the engine
runs them through ``kvserve.constraints.compiler``, which bounds it.

llguidance is imported by the functions that use it, not by this module:
the API and the engine import this module (``JSON_OPTIONS``, ``GrammarError``)
on every serving path, constrained or not (``tests/test_serving_imports.py``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.core.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

#: llguidance's JSON options for every schema (see the module docstring).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: The schema of ``response_format: {"type": "json_object"}``: any JSON object.
ANY_OBJECT = {"type": "object"}


class GrammarError(ValueError):
    """A constraint llguidance cannot compile; the message says why.

    ``param`` names the request field at fault when it is narrower than the
    constraint's own field (a tool's ``parameters``), else None.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def load_tokenizer(tokenizer_json: str | Path, vocab_size: int,
                   eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer of a checkpoint's ``tokenizer.json``, with
    ``vocab_size`` rows (the LM head's, >= the tokenizer's) and its EOS ids.

    Build it before serving: it holds the GIL all along (0.5 s for
    SmolLM2's 49,152 tokens), so built during serving it would stop every
    other thread, the event loop and the step's included, that long.
    Raises ``ValueError`` when llguidance cannot read the file.
    """
    import llguidance

    return llguidance.LLTokenizer(str(tokenizer_json), n_vocab=vocab_size,
                                  eos_token=list(eos_token_ids))


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's parser and lexer limits for every matcher: its defaults
    (lexer fuel 1,000,000; 250,000 lexer states; a grammar of 500,000
    symbols; 2,000 items in a row; 50,000 Earley items a step), with
    ``verbose_errors`` off so an error names the fault, not the grammar."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def to_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) of ``params``.

    Raises ``GrammarError`` when the constraint cannot be compiled (an
    invalid schema, regex or grammar); for a grammar that embeds schemas
    (``params.parts``), its ``param`` names the first schema at fault.
    """
    try:
        return _compile(params)
    except GrammarError as exc:
        for param, schema in params.parts:
            try:
                _compile(StructuredOutputsParams(json=schema))
            except GrammarError as part_exc:
                raise GrammarError(f"the JSON schema is invalid: {part_exc}", param) from exc
        raise


@lru_cache(maxsize=256)
def _compile(params: StructuredOutputsParams) -> str:
    import llguidance

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
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=parser_limits())
    if error:
        raise GrammarError(error)
    return grammar


def build_matcher(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """A fresh ``LLMatcher`` of ``grammar`` under ``parser_limits()``.

    Costs from microseconds to seconds (it builds the lexer over the
    vocabulary; 2,000 optional JSON properties take ~0.6 s, 4,000 ~3 s);
    llguidance drops the GIL meanwhile. Raises ``GrammarError`` when the
    matcher starts in error (a grammar over a limit).
    """
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    if matcher.is_error():
        raise GrammarError(matcher.get_error())
    return matcher


def check(params: StructuredOutputsParams) -> None:
    """Raise ``GrammarError`` (with llguidance's reason) if ``params`` does not compile."""
    to_grammar(params)
