"""The inference engine: requests, a continuous-batching scheduler, a runner over the paged KV cache, and ``LLM``.

>>> from tessera.engine import LLM, SamplingParams
>>> LLM().generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=8))[0].text
"""

from __future__ import annotations

from tessera.engine.llm import LLM
from tessera.engine.params import CompletionOutput, RequestOutput, SamplingParams
from tessera.engine.scheduler import Scheduler
from tessera.engine.sequence import Sequence

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "Scheduler", "Sequence"]
