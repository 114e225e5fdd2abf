"""JSON schemas the structured-output tests run (engine and server): nested objects, arrays, enums, bounded numbers,
required and optional fields, ``$ref``. Strings and arrays are bounded so that a random model's output ends within
a small ``max_tokens`` (an unbounded string is as long as the model's whim)."""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "maxLength": 6}

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "name": NAME,
            "address": {"type": "object", "properties": {"city": NAME, "zip": {"type": "string",
                                                                                 "pattern": "^[0-9]{3}$"}},
                        "required": ["city"], "additionalProperties": False},
            "nickname": NAME,
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "arrays_enums": {
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
            "size": {"enum": ["S", "M", "L"]},
            "flag": {"type": "boolean"},
        },
        "required": ["colors", "size", "flag"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "ratio": {"type": "number", "minimum": -1, "maximum": 1},
            "count": {"type": "integer", "exclusiveMinimum": 5, "maximum": 9},
        },
        "required": ["age", "ratio", "count"],
        "additionalProperties": False,
    },
    "refs": {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                             "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"},
                       "label": {"anyOf": [NAME, {"type": "null"}]}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "top_level_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 4},
}
