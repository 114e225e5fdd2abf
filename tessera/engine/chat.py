"""Render a conversation with a model's Jinja2 chat template."""

from __future__ import annotations

import functools
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

#: compiled templates kept; a server has one model, so one template (a few more for tools that load several)
TEMPLATE_CACHE_SIZE = 8


def render_chat(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text for ``messages`` (``[{"role": ..., "content": ...}, ...]``), ending with the assistant turn's
    opening when ``add_generation_prompt``. The template runs sandboxed: it comes from the checkpoint file.

    ``tools`` (OpenAI's ``[{"type": "function", "function": {...}}]``) is passed to templates that render tools
    themselves; it is always defined (None without tools), as Hugging Face's ``apply_chat_template`` does, so a
    template's ``{% if tools %}`` works under strict undefined checks.

    The template is compiled once per template text (:func:`compile_chat_template`), not per call.
    """
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"chat: message {i} must be a dict with 'role' and 'content', got {m!r}")
    return compile_chat_template(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                  tools=tools)


def _raise_exception(message: str) -> None:
    """What templates call to reject a conversation (Hugging Face's name)."""
    raise ValueError(f"chat template: {message}")


@functools.lru_cache(maxsize=TEMPLATE_CACHE_SIZE)
def compile_chat_template(template: str) -> jinja2.Template:
    """The compiled, sandboxed template for ``template``'s text, cached: compiling costs milliseconds, rendering
    microseconds. A compiled template holds no per-render state, so sharing it across threads is safe."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)
