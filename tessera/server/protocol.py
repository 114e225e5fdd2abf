"""The OpenAI wire format: request bodies (validated with pydantic), response bodies, and OpenAI-style errors.

Only what the server implements is modelled. Fields OpenAI defines that we cannot honour (``echo``, ``logit_bias``,
``suffix``, ...) are accepted only at their "off" value, so a client never silently gets something it did not ask for;
unknown extra fields are ignored, as OpenAI's own server does for forward compatibility.

Types are strict, as OpenAI's are: ``"0.5"`` is not a number, ``"yes"`` or ``1`` not a boolean, ``true`` or ``3.0`` not
an integer (pydantic's lax mode would accept all of these). A JSON integer is a valid number.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)

from tessera.engine.text_check import surrogate_message

#: Most choices one request may ask for (each is an engine request).
MAX_N = 64
#: Most strings in ``stop``, as OpenAI allows.
MAX_STOP = 4


class APIError(Exception):
    """An error the server reports as ``{"error": {"message", "type", "param", "code"}}`` with ``status``.

    Examples
    --------
    >>> raise APIError(404, "The model 'x' does not exist", code="model_not_found", param="model")
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ------------------------------------------------------------------------------------------------ requests
class _Request(BaseModel):
    # Unknown fields are ignored (OpenAI adds fields often); wrong types are errors (400).
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: StrictBool = False


class SamplingFields(_Request):
    """Fields shared by both endpoints, with OpenAI's ranges; ``top_k``, ``min_p``, ``repetition_penalty`` and
    ``ignore_eos`` are vLLM's extensions."""

    model: str | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: StrictFloat = Field(1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    presence_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    seed: StrictInt | None = Field(None, ge=-(2**63), lt=2**63 - MAX_N)  # what torch.Generator accepts, for seed + i
    user: str | None = None
    top_k: StrictInt = Field(0, ge=-1)
    min_p: StrictFloat = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: StrictFloat = Field(1.0, gt=0.0)
    ignore_eos: StrictBool = False
    logit_bias: dict[str, float] | None = None
    # structured output, vLLM's names (llama.cpp's ``grammar`` and ``json_schema`` are on completions)
    guided_json: dict[str, Any] | StrictBool | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP or not all(stops):
            raise ValueError(f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias:
            raise ValueError("logit_bias is not supported by this server; omit it")
        return bias


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of one string, or token ids (a list of ints, or a list of
    one list of ints); batches of several prompts are refused (send one request each, or use ``n``)."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=5)
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: str | None = None
    grammar: str | None = None  # llama.cpp's server: GBNF (or Lark)
    json_schema: dict[str, Any] | StrictBool | None = None  # llama.cpp's server

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, prompt: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # pydantic reports a union mismatch per member ("prompt.str: Input should be a valid string", ...), which
        # hides what a prompt may be; one message that lists the shapes says it
        try:
            return handler(prompt)
        except ValidationError:
            raise ValueError("prompt must be a string, a list of one string, a list of token ids (integers), or a "
                             f"list of one such list; got {describe(prompt)}") from None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ValueError(f"a list of {len(prompt)} prompts is not supported; send one prompt per request")
            prompt = prompt[0]
        if isinstance(prompt, str):
            _check_text(prompt, "the prompt")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported by this server; omit it")
        return echo

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported by this server; omit it")
        return suffix


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: which call this answers

    @field_validator("content")
    @classmethod
    def _valid_content(cls, content: str | list[ContentPart] | None) -> str | list[ContentPart] | None:
        if isinstance(content, str):
            _check_text(content, "the content")
        for i, part in enumerate(content if isinstance(content, list) else []):
            _check_text(part.text, f"content part {i}")
        return content

    def text(self) -> str:
        """The content as one string (text parts joined, as OpenAI does)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class JSONSchemaFormat(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Request):
    """``text``, ``json_object`` (any JSON object) or ``json_schema`` (JSON valid under ``json_schema.schema``; the
    grammar enforces it whether or not ``strict`` is set)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @field_validator("json_schema")
    @classmethod
    def _schema_given(cls, value: JSONSchemaFormat | None, info: ValidationInfo) -> JSONSchemaFormat | None:
        if info.data.get("type") == "json_schema" and (value is None or value.schema_ is None):
            raise ValueError('type "json_schema" needs json_schema: {"name": ..., "schema": {...}}; add the schema')
        return value


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``; the messages are rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        # OpenAI's rule: "logprobs must be set to true if this parameter is used"; ignoring it silently would
        # return no logprobs to a client that asked for some
        if top is not None and not info.data.get("logprobs", False):
            raise ValueError("top_logprobs needs logprobs: true; send both, or omit top_logprobs")
        return top

    @field_validator("tools")
    @classmethod
    def _distinct_tools(cls, tools: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in tools or []]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tools: each function needs its own name; {', '.join(twice)} appears more than once")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
            offered = ", ".join(t.function.name for t in tools) or "none"
            raise ValueError(f"tool_choice names the function '{choice.function.name}', which is not among the "
                             f"tools (offered: {offered}); name one of them")
        if choice == "required" and not tools:
            raise ValueError('tool_choice "required" needs tools; send tools, or tool_choice "auto" / "none"')
        return choice

    @property
    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (the current name) or else ``max_tokens`` (the deprecated one)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def describe(value: Any) -> str:
    """``value`` as a client wrote it: its JSON type and (shortened) JSON text, e.g. ``the string "0.5"``."""
    kind = {bool: "the boolean", int: "the integer", float: "the number", str: "the string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
    if value is None:
        return kind
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = repr(value)
    return f"{kind} {text if len(text) <= 60 else text[:57] + '...'}"


def _check_text(text: str, where: str) -> str:
    message = surrogate_message(text, where)
    if message is not None:
        raise ValueError(message)
    return text


# ----------------------------------------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = []


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tessera"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    """An OpenAI-looking response id, e.g. ``cmpl-1f0c...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
