"""The server with speculative decoding: streamed text, finish reasons, logprobs and usage equal a plain server's,
and /metrics reports the drafts."""

from __future__ import annotations

import httpx2

from tessera.engine.speculative import SpeculativeConfig
from tests.server.conftest import MODEL_NAME

PROMPT = "abcabcabcabcabcabc"  # repeats: the n-gram proposer drafts, and some drafts are accepted
ARGS = {"temperature": 0.0, "max_tokens": 24, "logprobs": 2}


def _stream(client) -> tuple[list[str], object]:
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **ARGS))
    deltas = [c.choices[0].text for c in chunks if c.choices]
    return deltas, chunks


def test_speculative_stream_equals_plain(make_server):
    with make_server() as plain:
        want_deltas, want = _stream(plain.client())
    spec = SpeculativeConfig("ngram", 4, adaptive=False)
    with make_server(llm_kwargs={"speculative": spec}) as running:
        deltas, got = _stream(running.client())
        metrics = httpx2.get(f"{running.url}/metrics").text
    assert "".join(deltas) == "".join(want_deltas)
    assert got[-1].usage.model_dump() == want[-1].usage.model_dump()
    finish = [c.choices[0].finish_reason for c in got if c.choices and c.choices[0].finish_reason]
    assert finish == [c.choices[0].finish_reason for c in want if c.choices and c.choices[0].finish_reason]
    tokens = [t for c in got if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    want_tokens = [t for c in want if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == want_tokens
    lines = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("tessera_spec_"))
    assert float(lines["tessera_spec_draft_tokens_total"]) > 0
    assert 0 < float(lines["tessera_spec_accepted_tokens_total"]) <= float(lines["tessera_spec_draft_tokens_total"])
