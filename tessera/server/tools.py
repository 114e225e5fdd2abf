"""Tool (function) calling over any chat template: tools into the prompt, a grammar for forced calls, calls parsed.

The model writes each call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the format of Hermes,
Qwen 2.5 and SmolLM3 templates). A chat template that takes ``tools`` itself (it names the variable) gets them as
OpenAI's list, and the conversation's assistant ``tool_calls`` and ``tool`` messages as Hugging Face's templates
expect them. Any other template gets a system message that lists the tools and states the format, assistant calls
written in that format, and ``tool`` messages as they are (role ``tool``). ``tool_choice: "required"`` or a named
function is enforced by a grammar (:func:`tool_grammar`); ``"auto"`` leaves the choice to the model and
:class:`ToolCallParser` finds the calls in whatever it wrote.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from tessera.engine.structured.compiler import JSON_OPTIONS

OPEN, CLOSE = "<tool_call>", "</tool_call>"
#: a call's JSON in the order the grammar writes it, up to the start of the arguments (streamed as they grow)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass(slots=True)
class Function:
    """One tool: its name, what it does, and the JSON schema of its arguments."""

    name: str
    description: str | None
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        described = {"description": self.description} if self.description else {}
        return {"type": "function", "function": {"name": self.name, **described, "parameters": self.parameters}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ----------------------------------------------------------------------------------------------------- prompt
def template_takes_tools(template: str) -> bool:
    """Whether a chat template renders ``tools`` itself (it refers to the variable)."""
    return re.search(r"\btools\b", template) is not None


def system_prompt(functions: list[Function]) -> str:
    """The instructions a template without tool support gets: the tools, and how to call one."""
    listed = "\n".join(json.dumps(f.openai()["function"], ensure_ascii=False) for f in functions)
    return ("You can call the following functions. To call one, answer with\n"
            f'{OPEN}{{"name":"<function name>","arguments":<the arguments as a JSON object>}}{CLOSE}\n'
            "(one block per call, nothing else in that answer). Functions:\n" + listed)


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (``arguments``: JSON text)."""
    try:
        args = json.dumps(json.loads(arguments), ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError):
        args = arguments  # a past call whose arguments were not JSON: shown as they were
    return f'{OPEN}{{"name":{json.dumps(name, ensure_ascii=False)},"arguments":{args}}}{CLOSE}'


def conversation(messages: list[dict[str, Any]], functions: list[Function], native: bool) -> list[dict[str, Any]]:
    """``messages`` (OpenAI's form, as dicts) as the chat template should see them.

    Parameters
    ----------
    messages : role, content (text), and for assistants ``tool_calls`` (OpenAI's), for tools ``tool_call_id``.
    functions : the request's tools when they go into the prompt (empty otherwise).
    native : the template renders tools itself (:func:`template_takes_tools`).
    """
    out = []
    for m in messages:
        calls = m.get("tool_calls") or []
        if native:
            entry = {"role": m["role"], "content": m.get("content") or ""}
            if calls:
                entry["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                    "name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}}
                    for c in calls]
            if m.get("tool_call_id") is not None:
                entry["tool_call_id"] = m["tool_call_id"]
            out.append(entry)
            continue
        text = m.get("content") or ""
        if calls:
            text += "".join(call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls)
        out.append({"role": m["role"], "content": text})
    if functions and not native:
        instructions = system_prompt(functions)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + instructions}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


def _arguments(arguments: str) -> Any:
    """Arguments for a template: a dict when the JSON text is one (Hugging Face templates iterate over them)."""
    try:
        return json.loads(arguments)
    except (TypeError, ValueError):
        return arguments


# ---------------------------------------------------------------------------------------------------- grammar
def tool_grammar(functions: list[Function], several: bool) -> str:
    """A Lark grammar (llguidance's dialect) whose sentences are one or more tool calls of ``functions``, nothing
    else; each call's arguments are JSON valid under its function's parameters schema.

    Parameters
    ----------
    functions : the functions that may be called (one, for a named ``tool_choice``).
    several : allow more than one call (``parallel_tool_calls``).
    """
    lines = ["start: call+" if several else "start: call",
             "call: " + " | ".join(f"c{i}" for i in range(len(functions)))]
    for i, f in enumerate(functions):
        head = json.dumps(f'{OPEN}{{"name":{json.dumps(f.name, ensure_ascii=False)},"arguments":', ensure_ascii=False)
        schema = {**f.parameters, "x-guidance": JSON_OPTIONS}
        lines.append(f"c{i}: {head} a{i} {json.dumps('}' + CLOSE)}")
        lines.append(f"a{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------- parser
@dataclass(slots=True)
class CallStart:
    """A tool call begins: ``index`` among this choice's calls, its id and function name."""

    index: int
    id: str
    name: str


@dataclass(slots=True)
class CallArguments:
    """More of call ``index``'s arguments (JSON text; the fragments joined are the whole arguments)."""

    index: int
    text: str


@dataclass(slots=True)
class Content:
    text: str


Event = CallStart | CallArguments | Content


@dataclass
class ToolCallParser:
    """Splits a choice's growing text into content and tool calls, for streams and for whole answers.

    :meth:`feed` takes each new piece of text and returns what can be sent now: content (text that cannot be the
    start of ``<tool_call>`` any more), a call's start (its name, once the JSON shows it) and pieces of its
    arguments (held back while they could still be the call's closing ``}</tool_call>``). :meth:`finish` flushes
    the rest. A block that does not parse as a call of a known function (the model's own invention) is given back
    as content, whole, when it closes.

    Parameters
    ----------
    names : the functions the request offers.
    """

    names: set[str]
    calls: list[dict[str, str]] = field(default_factory=list)  # [{"id", "name", "arguments"}] of the finished calls
    _buffer: str = ""
    _inside: bool = False
    _started: bool = False  # the current block's CallStart went out
    _sent_args: int = 0  # characters of the current block's arguments already sent

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            if not self._inside:
                at = self._buffer.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self._buffer, OPEN)
                    if len(self._buffer) > keep:
                        events.append(Content(self._buffer[:len(self._buffer) - keep]))
                        self._buffer = self._buffer[len(self._buffer) - keep:]
                    return events
                if at:
                    events.append(Content(self._buffer[:at]))
                self._buffer = self._buffer[at + len(OPEN):]
                self._inside, self._started, self._sent_args = True, False, 0
                continue
            end = self._buffer.find(CLOSE)
            if end < 0:
                events += self._stream_arguments()
                return events
            events += self._close(self._buffer[:end])
            self._buffer = self._buffer[end + len(CLOSE):]
            self._inside = False

    def finish(self) -> list[Event]:
        """The rest of the text at the end of the choice: an unclosed block or a held-back prefix as content (or
        the streamed call's last arguments, when it had started)."""
        events: list[Event] = []
        if self._inside and self._started:
            head = _HEAD.match(self._buffer)
            rest = self._buffer[head.end():] if head else ""
            if len(rest) > self._sent_args:
                events.append(CallArguments(len(self.calls) - 1, rest[self._sent_args:]))
            self.calls[-1]["arguments"] = rest
        elif self._inside:
            events.append(Content(OPEN + self._buffer))
        elif self._buffer:
            events.append(Content(self._buffer))
        self._buffer, self._inside = "", False
        return events

    def _stream_arguments(self) -> list[Event]:
        head = _HEAD.match(self._buffer)
        if head is None:
            return []
        name = json.loads(f'"{head.group(1)}"')
        if name not in self.names:
            return []  # not a call of ours: decided at the close, returned as content then
        events: list[Event] = []
        if not self._started:
            self._started = True
            self.calls.append({"id": new_call_id(), "name": name, "arguments": ""})
            events.append(CallStart(len(self.calls) - 1, self.calls[-1]["id"], name))
        args = self._buffer[head.end():]
        safe = len(args) - _closing_hold(args)
        if safe > self._sent_args:
            events.append(CallArguments(len(self.calls) - 1, args[self._sent_args:safe]))
            self._sent_args = safe
        return events

    def _close(self, block: str) -> list[Event]:
        """The events for a block that just closed: the rest of a streamed call, a whole call, or content."""
        call = _parse_call(block, self.names)
        if self._started:
            head = _HEAD.match(block)
            args = block[head.end():].rstrip()
            args = args[:-1].rstrip() if args.endswith("}") else args
            self.calls[-1]["arguments"] = args if call is None else call[1]
            rest = args[self._sent_args:]
            return [CallArguments(len(self.calls) - 1, rest)] if rest else []
        if call is None:
            return [Content(OPEN + block + CLOSE)]
        self.calls.append({"id": new_call_id(), "name": call[0], "arguments": call[1]})
        index = len(self.calls) - 1
        return [CallStart(index, self.calls[-1]["id"], call[0]), CallArguments(index, call[1])]


def _parse_call(block: str, names: set[str]) -> tuple[str, str] | None:
    """``(name, arguments JSON text)`` of one block, or None when it is not a call of a known function."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        return value["name"], args
    return value["name"], json.dumps(args, ensure_ascii=False, separators=(",", ":"))


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _closing_hold(args: str) -> int:
    """How much of the end of a call's arguments so far could still be the call's closing ``}`` (with spaces) and
    the start of ``</tool_call>``: held back until the next text shows what it is."""
    tail = _partial_suffix(args, CLOSE)
    body = args[:len(args) - tail].rstrip()
    if body.endswith("}"):
        return len(args) - len(body) + 1
    return tail


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[dict[str, str]]]:
    """A whole answer's content (None when only calls) and its calls (``{"id", "name", "arguments"}``)."""
    parser = ToolCallParser(names)
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    return (content if content.strip() or not parser.calls else None), parser.calls
