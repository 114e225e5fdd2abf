"""FastAPI's request validation errors as OpenAI error bodies: 400, the parameter named, what came and what to send.

FastAPI answers a body that fails validation with 422 and a list of pydantic errors; OpenAI's clients expect 400 with
one message and ``param`` naming the field (``temperature``, ``messages``), never a character offset.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tessera.server.protocol import APIError, describe

#: pydantic's names for the members of a union type, which it puts in an error's location after the field
#: (``messages.0.content.str``); they are not part of the request, so they are left out of the path shown
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_tag(part: Any) -> bool:
    return isinstance(part, str) and (part in _UNION_TAGS or "[" in part or "-" in part)


def _field_path(loc: Sequence[Any]) -> list[str]:
    """The location as the client wrote it: ``messages.0.content``, without FastAPI's ``body`` or union tags."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    return [str(x) for x in parts if not _is_tag(x)]


def validation_error(errors: Sequence[dict[str, Any]]) -> APIError:
    """The 400 for the first of FastAPI's validation ``errors``.

    Examples
    --------
    >>> validation_error([{"type": "float_type", "loc": ("body", "temperature"), "msg": "Input should be a valid "
    ...                    "number", "input": "0.5"}]).message
    'temperature: Input should be a valid number, got the string "0.5"'
    """
    if not errors:
        return APIError(400, "The request body is invalid")
    first = errors[0]
    kind, ctx = first.get("type", ""), first.get("ctx") or {}
    if kind == "json_invalid":
        loc = first.get("loc", ())
        where = f" at character {loc[-1]}" if loc and isinstance(loc[-1], int) else ""
        return APIError(400, f"The request body is not valid JSON: {ctx.get('error', first.get('msg'))}{where}; "
                             "send one JSON object")
    path = _field_path(first.get("loc", ()))
    if kind == "value_error" and "error" in ctx:
        message = str(ctx["error"])  # our own validators' messages already say what came and what to send
    else:
        message = first.get("msg", "invalid value")
        if kind.endswith("_type") or kind.endswith("_parsing") or kind == "literal_error":
            message = f"{message}, got {describe(first.get('input'))}"
    return APIError(400, f"{'.'.join(path) or 'body'}: {message}", param=path[0] if path else None)
