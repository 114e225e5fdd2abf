"""A request's structured-output fields -> the one engine constraint (``SamplingParams`` keyword), or a 400.

The OpenAI surface has several spellings of the same thing: ``response_format`` (chat), vLLM's ``guided_json`` /
``guided_regex`` / ``guided_grammar`` (both endpoints), llama.cpp's ``grammar`` and ``json_schema`` (completions),
and a tool choice that forces calls (chat). One request may use one of them; each is compiled here, once, so a bad
schema or grammar is a 400 that names the field before anything is queued.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessera.engine import SamplingParams
from tessera.server import protocol as p


@dataclass(slots=True)
class Constraint:
    """The engine keyword (``json_schema``, ``regex``, ``grammar`` or ``json_object``), its value, and the request
    field it came from (for error messages)."""

    keyword: str
    value: Any
    param: str

    def kwargs(self) -> dict[str, Any]:
        return {self.keyword: self.value}


def _from_guided(req: p.SamplingFields) -> list[Constraint]:
    found = []
    if req.guided_json is not None:
        found.append(Constraint("json_schema", req.guided_json, "guided_json"))
    if req.guided_regex is not None:
        found.append(Constraint("regex", req.guided_regex, "guided_regex"))
    if req.guided_grammar is not None:
        found.append(Constraint("grammar", req.guided_grammar, "guided_grammar"))
    return found


def completion_constraints(req: p.CompletionRequest) -> list[Constraint]:
    """The structured-output fields a completion request set (llama.cpp's and vLLM's names)."""
    found = _from_guided(req)
    if req.grammar is not None:
        found.append(Constraint("grammar", req.grammar, "grammar"))
    if req.json_schema is not None:
        found.append(Constraint("json_schema", req.json_schema, "json_schema"))
    return found


def chat_constraints(req: p.ChatCompletionRequest, tool_grammar: str | None) -> list[Constraint]:
    """The structured-output fields a chat request set; ``tool_grammar`` is the grammar a forced tool choice needs."""
    found = _from_guided(req)
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(Constraint("json_object", True, "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        found.append(Constraint("json_schema", fmt.json_schema.schema_, "response_format"))
    if tool_grammar is not None:
        found.append(Constraint("grammar", tool_grammar, "tool_choice"))
    return found


def one_constraint(found: list[Constraint]) -> Constraint | None:
    """The request's constraint, compiled once to check it.

    Raises
    ------
    APIError
        400 when several fields ask for structured output, or when the one asked for does not compile (the
        message names the field and the problem).
    """
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(c.param for c in found)
        raise p.APIError(400, f"{names} each constrain the output and only one constraint per request is supported; "
                              "keep one of them", param=found[1].param)
    (constraint,) = found
    try:
        SamplingParams(**constraint.kwargs())
    except (ValueError, TypeError) as err:
        raise p.APIError(400, f"{constraint.param}: {err}", param=constraint.param) from err
    return constraint
