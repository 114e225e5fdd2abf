"""A chat request's tools: which functions are offered, the grammar a forced choice needs, the rendered prompt, and
parser events as OpenAI's streamed ``tool_calls`` deltas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessera.engine.chat import render_chat
from tessera.server import protocol as p
from tessera.server.tools import (
    CallArguments,
    CallStart,
    Content,
    Event,
    Function,
    conversation,
    template_takes_tools,
    tool_grammar,
)

#: the parameters schema of a function that declares none: an object, with anything in it
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(slots=True)
class ChatTools:
    """The tools of one chat request.

    Attributes
    ----------
    functions : the offered functions (empty with no tools, or ``tool_choice: "none"``).
    forced : the functions a call must be of when a call is required (all for ``"required"``, one for a named
        choice), else empty.
    several : more than one call allowed (``parallel_tool_calls``; a named choice makes one call).
    """

    functions: list[Function]
    forced: list[Function]
    several: bool

    @classmethod
    def of(cls, req: p.ChatCompletionRequest) -> ChatTools:
        if not req.tools or req.tool_choice == "none":
            return cls([], [], False)
        functions = [Function(t.function.name, t.function.description, t.function.parameters or ANY_OBJECT)
                     for t in req.tools]
        choice = req.tool_choice
        if isinstance(choice, p.NamedToolChoice):
            return cls(functions, [f for f in functions if f.name == choice.function.name], False)
        return cls(functions, functions if choice == "required" else [], req.parallel_tool_calls)

    @property
    def names(self) -> set[str]:
        """The names whose calls are parsed from the output (empty: no parsing, plain content)."""
        return {f.name for f in self.functions}

    def grammar(self) -> str | None:
        """The Lark grammar that forces calls (``required`` or a named function), or None."""
        return tool_grammar(self.forced, self.several) if self.forced else None

    def render(self, template: str, messages: list[p.ChatMessage]) -> str:
        """The prompt: ``messages`` (tool calls and results included) and the tools, through the chat template.

        Raises
        ------
        APIError
            400 when the template refuses the conversation (it is the checkpoint's code; its error says why).
        """
        native = template_takes_tools(template)
        dicts = [{"role": m.role, "content": m.text(),
                  "tool_calls": [c.model_dump() for c in m.tool_calls] if m.tool_calls else None,
                  "tool_call_id": m.tool_call_id} for m in messages]
        try:
            return render_chat(template, conversation(dicts, self.functions, native),
                               tools=[f.openai() for f in self.functions] if native and self.functions else None)
        except Exception as err:  # the template is the checkpoint's code: any error it raises means a bad conversation
            raise p.APIError(400, f"The chat template refused the messages: {err}", param="messages") from err


def tool_deltas(events: list[Event]) -> list[dict[str, Any]]:
    """Parser events as the ``delta`` objects of OpenAI's chat chunks: content, then one ``tool_calls`` entry per
    event (a call's first delta carries its id, type and name with empty arguments; later ones add arguments)."""
    deltas: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, Content) and e.text:
            if deltas and "content" in deltas[-1]:
                deltas[-1]["content"] += e.text
            else:
                deltas.append({"content": e.text})
        elif isinstance(e, CallStart):
            deltas.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                           "function": {"name": e.name, "arguments": ""}}]})
        elif isinstance(e, CallArguments) and e.text:
            deltas.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
    return deltas
