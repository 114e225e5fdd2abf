"""The two generation endpoints: OpenAI request -> engine submission -> OpenAI response or SSE stream.

``/v1/completions`` and ``/v1/chat/completions`` differ only in how the prompt is made (as given, or the chat template
over the messages) and in the shape of their answers, so both run :func:`_prepare` and :func:`_collect`; each has
its own builders for the final body and for stream chunks.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from tessera.engine import SamplingParams
from tessera.server import protocol as p
from tessera.server.bridge import ClientGone, EngineCall
from tessera.server.chat_tools import ChatTools, tool_deltas
from tessera.server.constraints import Constraint, chat_constraints, completion_constraints, one_constraint
from tessera.server.engine_loop import EngineLoop, Prompt
from tessera.server.tools import ToolCallParser, parse_tool_calls

#: OpenAI's default ``max_tokens`` for legacy completions.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass(slots=True)
class ServerSettings:
    """What the endpoints need besides the request: the engine and the server's limits."""

    engine: EngineLoop
    model_name: str
    max_tokens_limit: int
    chat_template: str | None


@dataclass(slots=True)
class Choice:
    """One choice's accumulated output (non-streaming)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    top: list[list[tuple[str, float]]] = field(default_factory=list)
    finish_reason: str | None = None


# ---------------------------------------------------------------------------------------------- shared steps
def _check_model(settings: ServerSettings, model: str | None) -> None:
    if model is not None and model != settings.model_name:
        raise p.APIError(404, f"The model '{model}' does not exist; this server serves '{settings.model_name}' "
                              "(GET /v1/models)", param="model", code="model_not_found")


def _sampling(req: p.SamplingFields, max_tokens: int, logprobs: bool, top: int = 0,
              constraint: Constraint | None = None) -> list[SamplingParams]:
    """One SamplingParams per choice; with a seed, choice i uses seed + i so seeded choices differ yet repeat."""
    extra = constraint.kwargs() if constraint is not None else {}
    try:
        return [SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                               repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                               frequency_penalty=req.frequency_penalty,
                               seed=None if req.seed is None else req.seed + i, max_tokens=max_tokens,
                               stop=list(req.stop or []), ignore_eos=req.ignore_eos, logprobs=logprobs,
                               top_logprobs=top, **extra)
                for i in range(req.n)]
    except (ValueError, TypeError) as err:
        raise p.APIError(400, str(err)) from err


def _limit(settings: ServerSettings, max_tokens: int | None, param: str) -> int:
    if max_tokens is not None and max_tokens > settings.max_tokens_limit:
        raise p.APIError(400, f"{param}={max_tokens} is more than this server allows ({settings.max_tokens_limit}); "
                              f"ask for at most {settings.max_tokens_limit}", param=param)
    return settings.max_tokens_limit if max_tokens is None else max_tokens


async def _prepare(settings: ServerSettings, prompt: Prompt, params: list[SamplingParams], fit: bool,
                   request: Request) -> tuple[EngineCall, int]:
    """Submit and wait for admission, watching the client's connection all the while (a disconnect cancels)."""
    call = EngineCall(settings.engine, prompt, params, fit_max_tokens=fit, request=request)
    return call, await call.admitted()


async def _collect(call: EngineCall) -> list[Choice]:
    choices = [Choice() for _ in range(call.num_choices)]
    async for d in call.deltas():
        c = choices[d.index]
        c.text += d.text
        c.token_ids += d.token_ids
        c.logprobs += d.logprobs
        c.tokens += d.tokens
        c.top += d.top
        c.finish_reason = d.finish_reason or c.finish_reason
    return choices


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _sse_stream(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """``data: {...}`` per chunk, then ``data: [DONE]``; an error after the headers went out becomes an error chunk."""
    try:
        async for payload in events:
            yield _sse(payload)
    except p.APIError as err:
        yield _sse(err.body())
    except ClientGone:  # the client left before the stream started: nobody to write to
        return
    yield "data: [DONE]\n\n"


class EngineStream(StreamingResponse):
    """An SSE response that cancels its engine call however the response ends.

    Starlette cancels the body's task when the client disconnects; the cancellation reaches the generators only
    if they were awaiting, not if they were paused at a ``yield``. Cancelling here covers both (a no-op once the
    call finished), so a vanished client never keeps its KV pages.
    """

    def __init__(self, call: EngineCall, events: AsyncIterator[dict[str, Any]]) -> None:
        super().__init__(_sse_stream(events), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.call = call
        call.stop_watching()  # Starlette's own listener watches the connection from here on

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.call.cancel()


# ------------------------------------------------------------------------------------------------ completions
async def completions(settings: ServerSettings, req: p.CompletionRequest, request: Request) -> Any:
    """``POST /v1/completions``."""
    _check_model(settings, req.model)
    if req.best_of is not None and req.best_of != req.n:
        raise p.APIError(400, "best_of is not supported (only best_of == n); omit it", param="best_of")
    wanted = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    params = _sampling(req, _limit(settings, wanted, "max_tokens"), logprobs=req.logprobs is not None,
                       top=req.logprobs or 0, constraint=one_constraint(completion_constraints(req)))
    call, prompt_tokens = await _prepare(settings, req.prompt, params, fit=False, request=request)
    rid, created = p.new_id("cmpl"), p.now()
    if req.stream:
        usage = req.stream_options is not None and req.stream_options.include_usage
        return EngineStream(call, _completion_chunks(call, settings.model_name, rid, created, prompt_tokens, usage))
    choices = await _collect(call)
    return p.CompletionResponse(
        id=rid, created=created, model=settings.model_name,
        choices=[p.CompletionChoice(index=i, text=c.text, finish_reason=c.finish_reason,
                                    logprobs=_completion_logprobs(c.tokens, c.logprobs, c.top)
                                    if params[0].logprobs
                                    else None) for i, c in enumerate(choices)],
        usage=p.Usage.of(prompt_tokens, sum(len(c.token_ids) for c in choices)))


def _completion_logprobs(tokens: list[str], logprobs: list[float], top: list[list[tuple[str, float]]],
                         offset: int = 0) -> dict[str, Any]:
    """OpenAI's legacy logprobs: per token its text, logprob, offset, and a dict of the ``logprobs`` most likely
    tokens plus the sampled one (as vLLM: up to ``logprobs + 1`` entries)."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    tops = []
    for i, (t, lp) in enumerate(zip(tokens, logprobs)):
        alternatives = dict(top[i]) if i < len(top) else {}
        alternatives.setdefault(t, lp)
        tops.append(alternatives)
    return p.CompletionLogprobs(tokens=tokens, token_logprobs=logprobs, text_offset=offsets,
                                top_logprobs=tops).model_dump()


async def _completion_chunks(call: EngineCall, model: str, rid: str, created: int, prompt_tokens: int,
                             include_usage: bool) -> AsyncIterator[dict[str, Any]]:
    generated = 0
    offsets = [0] * call.num_choices
    async for d in call.deltas():
        generated += len(d.token_ids)
        if not d.text and d.finish_reason is None and not d.tokens:
            continue
        logprobs = _completion_logprobs(d.tokens, d.logprobs, d.top, offsets[d.index]) if d.tokens else None
        offsets[d.index] += sum(len(t) for t in d.tokens)
        choice = {"index": d.index, "text": d.text, "logprobs": logprobs, "finish_reason": d.finish_reason}
        yield {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice],
               **({"usage": None} if include_usage else {})}
    if include_usage:
        yield {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
               "usage": p.Usage.of(prompt_tokens, generated).model_dump()}


# ----------------------------------------------------------------------------------------------------- chat
async def chat_completions(settings: ServerSettings, req: p.ChatCompletionRequest, request: Request) -> Any:
    """``POST /v1/chat/completions``: the chat template renders the messages, then as completions."""
    _check_model(settings, req.model)
    if settings.chat_template is None:
        raise p.APIError(400, "This model has no chat template; use /v1/completions with a rendered prompt",
                         param="messages")
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    limit = req.token_limit
    offered = ChatTools.of(req)
    params = _sampling(req, _limit(settings, limit, param), logprobs=req.logprobs,
                       top=(req.top_logprobs or 0) if req.logprobs else 0,
                       constraint=one_constraint(chat_constraints(req, offered.grammar())))
    prompt = offered.render(settings.chat_template, req.messages)
    call, prompt_tokens = await _prepare(settings, prompt, params, fit=limit is None, request=request)
    rid, created = p.new_id("chatcmpl"), p.now()
    top = req.top_logprobs or 0
    if req.stream:
        usage = req.stream_options is not None and req.stream_options.include_usage
        return EngineStream(call, _chat_chunks(call, settings.model_name, rid, created, prompt_tokens, usage, top,
                                               offered.names))
    choices = await _collect(call)
    return p.ChatCompletionResponse(
        id=rid, created=created, model=settings.model_name,
        choices=[_chat_choice(i, c, offered.names, req.logprobs) for i, c in enumerate(choices)],
        usage=p.Usage.of(prompt_tokens, sum(len(c.token_ids) for c in choices)))


def _chat_choice(index: int, c: Choice, names: set[str], logprobs: bool) -> p.ChatChoice:
    """A finished choice; with tools offered, the calls in its text become ``tool_calls``."""
    content: str | None = c.text
    calls: list[dict[str, str]] = []
    if names:
        content, calls = parse_tool_calls(c.text, names)
    finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
    message = p.AssistantMessage(content=content, tool_calls=[
        p.ResponseToolCall(id=t["id"], function=p.ResponseFunctionCall(name=t["name"], arguments=t["arguments"]))
        for t in calls] or None)
    return p.ChatChoice(index=index, message=message, finish_reason=finish,
                        logprobs=_chat_logprobs(c.tokens, c.logprobs, c.top) if logprobs else None)


def _chat_logprobs(tokens: list[str], logprobs: list[float], top: list[list[tuple[str, float]]]) -> p.ChatLogprobs:
    """Per token: its text, logprob, UTF-8 bytes, and the ``top_logprobs`` most likely tokens (most likely first)."""
    content = []
    for i, (t, lp) in enumerate(zip(tokens, logprobs)):
        alternatives = [p.TopLogprob(token=a, logprob=alp, bytes=list(a.encode("utf-8")))
                        for a, alp in (top[i] if i < len(top) else [])]
        content.append(p.TokenLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8")), top_logprobs=alternatives))
    return p.ChatLogprobs(content=content)


async def _chat_chunks(call: EngineCall, model: str, rid: str, created: int, prompt_tokens: int,
                       include_usage: bool, top: int, tool_names: set[str]) -> AsyncIterator[dict[str, Any]]:
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    tail = {"usage": None} if include_usage else {}
    for i in range(call.num_choices):  # OpenAI opens each choice with the role
        yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}], **tail}
    parsers = [ToolCallParser(tool_names) for _ in range(call.num_choices)] if tool_names else None
    generated = 0
    async for d in call.deltas():
        generated += len(d.token_ids)
        if not d.text and d.finish_reason is None and not d.tokens:
            continue
        logprobs = _chat_logprobs(d.tokens, d.logprobs, d.top).model_dump() if d.tokens else None
        if parsers is None:
            delta = {"content": d.text} if d.text or d.tokens else {}
            yield {**head, "choices": [{"index": d.index, "delta": delta, "logprobs": logprobs,
                                        "finish_reason": d.finish_reason}], **tail}
            continue
        parser = parsers[d.index]
        deltas = tool_deltas(parser.feed(d.text) + (parser.finish() if d.finish_reason else []))
        finish = d.finish_reason
        if finish == "stop" and parser.calls:
            finish = "tool_calls"
        if not deltas and (logprobs is not None or finish is not None):
            deltas = [{}]
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            yield {**head, "choices": [{"index": d.index, "delta": delta, "logprobs": logprobs if k == 0 else None,
                                        "finish_reason": finish if last else None}], **tail}
    if include_usage:
        yield {**head, "choices": [], "usage": p.Usage.of(prompt_tokens, generated).model_dump()}

