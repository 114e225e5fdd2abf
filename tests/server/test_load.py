"""64 concurrent streaming requests through a small batch and KV pool: every greedy result equals its prompt run
alone (batching, chunked prefill, preemption and the engine loop never change an answer)."""

from __future__ import annotations

import asyncio

import httpx2
import openai

from tests.server.conftest import MODEL_NAME

NUM_REQUESTS = 64
MAX_TOKENS = 8


def prompts() -> list[str]:
    words = ["sea", "stone", "wind", "fire", "river", "moon", "glass", "salt"]
    return [f"{i}: a story of {words[i % 8]} and {words[(i * 3) % 8]}{'!' * (i % 5)}" for i in range(NUM_REQUESTS)]


async def stream_one(client: openai.AsyncOpenAI, prompt: str, chat: bool) -> str:
    if chat:
        stream = await client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                                      temperature=0.0, max_tokens=MAX_TOKENS, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0.0, max_tokens=MAX_TOKENS,
                                             stream=True)
    return "".join([c.choices[0].text async for c in stream if c.choices])


async def stream_all(url: str, jobs: list[tuple[str, bool]]) -> list[str]:
    limits = httpx2.Limits(max_connections=NUM_REQUESTS)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120,
                                  http_client=openai.DefaultAsyncHttpxClient(limits=limits)) as client:
        return await asyncio.gather(*(stream_one(client, prompt, chat) for prompt, chat in jobs))


def test_64_concurrent_streams_equal_single_runs(make_server):
    # 16 running at most, 64 pages of 4 tokens (each request needs ~8): requests wait, get preempted, recompute
    with make_server(llm_kwargs={"max_num_seqs": 16, "num_pages": 64, "max_num_batched_tokens": 48}) as running:
        client = running.client()
        jobs = [(prompt, i % 2 == 1) for i, prompt in enumerate(prompts())]  # half completions, half chat
        alone = []
        for prompt, chat in jobs:
            if chat:
                out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                                     temperature=0.0, max_tokens=MAX_TOKENS)
                alone.append(out.choices[0].message.content)
            else:
                out = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0.0,
                                                max_tokens=MAX_TOKENS)
                alone.append(out.choices[0].text)
        together = asyncio.run(stream_all(running.url, jobs))
        assert together == alone
        assert len(set(alone)) > NUM_REQUESTS // 2  # the prompts really differ
        stats = running.engine.stats()
        assert stats["num_preemptions"] > 0 and stats["kv_pages_used"] <= stats["kv_pages_total"]
        assert stats["num_running"] == 0 and stats["queue_length"] == 0
