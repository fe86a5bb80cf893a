"""Twenty JSON schemas of the shapes clients send (nested objects, arrays,
enums, bounded numbers, required fields, unions), each with a prompt that
asks for it. Strings and arrays are bounded so a 135M model's answer ends
well inside ``max_tokens``."""

from __future__ import annotations

NAME = {"type": "string", "maxLength": 16}

SCHEMAS: list[tuple[str, dict]] = [
    ("person", {"type": "object", "properties": {"name": NAME, "age": {
        "type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"],
        "additionalProperties": False}),
    ("colour", {"type": "object", "properties": {"colour": {
        "enum": ["red", "green", "blue"]}}, "required": ["colour"]}),
    ("flags", {"type": "object", "properties": {"done": {"type": "boolean"}, "urgent": {
        "type": "boolean"}}, "required": ["done", "urgent"], "additionalProperties": False}),
    ("list", {"type": "object", "properties": {"items": {"type": "array", "items": NAME,
                                                         "minItems": 1, "maxItems": 3}},
              "required": ["items"], "additionalProperties": False}),
    ("nested", {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": NAME, "address": {"type": "object", "properties": {
            "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False}),
    ("score", {"type": "object", "properties": {"score": {
        "type": "integer", "minimum": 1, "maximum": 10}, "comment": NAME},
        "required": ["score", "comment"], "additionalProperties": False}),
    ("temperature", {"type": "object", "properties": {"celsius": {
        "type": "number", "minimum": -50, "maximum": 60}}, "required": ["celsius"],
        "additionalProperties": False}),
    ("point", {"type": "object", "properties": {"x": {"type": "integer", "minimum": -100,
                                                      "maximum": 100},
                                                "y": {"type": "integer", "minimum": -100,
                                                      "maximum": 100}},
               "required": ["x", "y"], "additionalProperties": False}),
    ("matrix", {"type": "object", "properties": {"rows": {"type": "array", "maxItems": 2,
                                                          "minItems": 1, "items": {
        "type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "integer", "minimum": 0, "maximum": 9}}}},
        "required": ["rows"], "additionalProperties": False}),
    ("optional", {"type": "object", "properties": {"title": NAME, "subtitle": NAME},
                  "required": ["title"], "additionalProperties": False}),
    ("nullable", {"type": "object", "properties": {"nickname": {"type": ["string", "null"],
                                                                "maxLength": 12}},
                  "required": ["nickname"], "additionalProperties": False}),
    ("union", {"type": "object", "properties": {"value": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 999}, {"type": "boolean"}]}},
        "required": ["value"], "additionalProperties": False}),
    ("const", {"type": "object", "properties": {"version": {"const": "v1"},
                                                "ok": {"type": "boolean"}},
               "required": ["version", "ok"], "additionalProperties": False}),
    ("objects", {"type": "object", "properties": {"pets": {"type": "array", "minItems": 1,
                                                           "maxItems": 2, "items": {
        "type": "object", "properties": {"kind": {"enum": ["cat", "dog", "fish"]},
                                         "name": NAME},
        "required": ["kind", "name"], "additionalProperties": False}}},
        "required": ["pets"], "additionalProperties": False}),
    ("date", {"type": "object", "properties": {"date": {
        "type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
        "required": ["date"], "additionalProperties": False}),
    ("weekday", {"type": "object", "properties": {"day": {"enum": [
        "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]},
        "open": {"type": "boolean"}}, "required": ["day", "open"],
        "additionalProperties": False}),
    ("ratings", {"type": "object", "properties": {"ratings": {"type": "array", "minItems": 1,
                                                              "maxItems": 4, "items": {
        "type": "integer", "minimum": 1, "maximum": 5}}}, "required": ["ratings"],
        "additionalProperties": False}),
    ("product", {"type": "object", "properties": {"name": NAME, "price": {
        "type": "integer", "minimum": 1, "maximum": 1000}, "in_stock": {"type": "boolean"},
        "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["new", "sale", "eco"]}}},
        "required": ["name", "price", "in_stock", "tags"], "additionalProperties": False}),
    ("answer", {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                                 "confidence": {"type": "integer",
                                                                "minimum": 0, "maximum": 100}},
                "required": ["answer", "confidence"], "additionalProperties": False}),
    ("book", {"type": "object", "properties": {"title": NAME, "author": {
        "type": "object", "properties": {"first": NAME, "last": NAME},
        "required": ["first", "last"], "additionalProperties": False},
        "year": {"type": "integer", "minimum": 1400, "maximum": 2030}},
        "required": ["title", "author", "year"], "additionalProperties": False}),
]


def prompt_for(name: str) -> str:
    """A user message asking for the ``name`` object."""
    return f"Reply with a short JSON object describing a {name}."
