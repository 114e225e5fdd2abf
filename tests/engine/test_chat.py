"""The chat template: rendered sandboxed, compiled once per template text."""

from __future__ import annotations

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tessera.engine.chat import render_chat

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_render():
    assert render_chat(TEMPLATE, [{"role": "user", "content": "hi"}]) == "<user>hi\n<assistant>"
    assert render_chat(TEMPLATE, [{"role": "user", "content": "hi"}], add_generation_prompt=False) == "<user>hi\n"


def test_template_is_compiled_once(monkeypatch):
    compiles = []
    from_string = ImmutableSandboxedEnvironment.from_string

    def counting(self, source, *args, **kwargs):
        compiles.append(source)
        return from_string(self, source, *args, **kwargs)

    monkeypatch.setattr(ImmutableSandboxedEnvironment, "from_string", counting)
    template = TEMPLATE + "{# test_template_is_compiled_once #}"  # a text no other test compiled
    for content in ("one", "two", "three"):
        assert render_chat(template, [{"role": "user", "content": content}]).startswith(f"<user>{content}")
    assert compiles == [template]


def test_template_can_refuse_a_conversation():
    refusing = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="chat template: roles must alternate"):
        render_chat(refusing, [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="message 0 must be a dict"):
        render_chat(TEMPLATE, [("user", "x")])
