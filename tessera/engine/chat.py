"""Render a conversation with a model's Jinja2 chat template."""

from __future__ import annotations

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


def render_chat(template: str, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The prompt text for ``messages`` (``[{"role": ..., "content": ...}, ...]``), ending with the assistant turn's
    opening when ``add_generation_prompt``. The template runs sandboxed: it comes from the checkpoint file."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"chat: message {i} must be a dict with 'role' and 'content', got {m!r}")

    def raise_exception(message: str) -> None:  # templates call it to reject a conversation
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt)
