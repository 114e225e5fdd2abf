"""Server metrics in the Prometheus text format, written by hand (no ``prometheus_client`` dependency).

Counters and histograms are updated from two threads (HTTP handlers and the engine loop), so every update takes one
lock. Engine gauges (KV pages, queue) are not stored here: :meth:`ServerMetrics.render` reads them from a snapshot
the engine loop publishes, because only that thread may touch the engine.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping

PREFIX = "tessera"
#: Seconds; fine at the low end, where CPU decode steps of small models live.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

Labels = tuple[tuple[str, str], ...]


class Histogram:
    """Cumulative-bucket histogram (Prometheus ``le`` semantics): ``counts[i]`` observations <= ``buckets[i]``."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1  # made cumulative when rendered, so an observation costs O(log buckets)
        self.count += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for le, n in zip(self.buckets, self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{le:g}"}} {running}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.9g}", f"{name}_count {self.count}"]
        return out


#: name -> (type, help); the order is the order of the /metrics page.
METRICS: dict[str, tuple[str, str]] = {
    "http_requests_total": ("counter", "HTTP requests answered, by endpoint and status code."),
    "requests_finished_total": ("counter", "Engine requests (one per choice) finished, by finish reason."),
    "requests_rejected_total": ("counter", "Engine requests refused before running, by reason."),
    "prompt_tokens_total": ("counter", "Prompt tokens of admitted requests."),
    "generation_tokens_total": ("counter", "Generated tokens."),
    "time_to_first_token_seconds": ("histogram", "Arrival to first generated token, per request."),
    "inter_token_latency_seconds": ("histogram", "Time between consecutive generated tokens of a request."),
    "e2e_request_latency_seconds": ("histogram", "Arrival to finish, per request."),
    "num_requests_running": ("gauge", "Requests in the running batch."),
    "num_requests_waiting": ("gauge", "Requests queued (not yet admitted to the running batch)."),
    "kv_pages_used": ("gauge", "KV cache pages held by requests or the prefix cache's live entries."),
    "kv_pages_total": ("gauge", "KV cache pages."),
    "kv_cache_usage_ratio": ("gauge", "kv_pages_used / kv_pages_total."),
    "prefix_cache_queried_tokens_total": ("counter", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hit_tokens_total": ("counter", "Prompt tokens served from the prefix cache."),
    "prefix_cache_hit_rate": ("gauge", "prefix_cache_hit_tokens_total / prefix_cache_queried_tokens_total."),
    "num_preemptions_total": ("counter", "Requests preempted (their KV freed, recomputed later)."),
    "spec_draft_tokens_total": ("counter", "Speculative decoding: tokens drafted and verified."),
    "spec_accepted_tokens_total": ("counter", "Speculative decoding: drafted tokens the target accepted."),
    "spec_acceptance_rate": ("gauge", "spec_accepted_tokens_total / spec_draft_tokens_total."),
    "spec_mean_accepted_length": ("gauge", "Tokens emitted per verified sequence-step (accepted drafts + 1)."),
    "spec_draft_seconds_total": ("counter", "Seconds spent drafting (proposer forwards and lookups)."),
}

# Engine stats key (LLM.stats() plus the loop's queue) -> metric name.
_ENGINE_GAUGES = {
    "num_running": "num_requests_running",
    "queue_length": "num_requests_waiting",
    "kv_pages_used": "kv_pages_used",
    "kv_pages_total": "kv_pages_total",
    "prefix_cache_queried_tokens": "prefix_cache_queried_tokens_total",
    "prefix_cache_hit_tokens": "prefix_cache_hit_tokens_total",
    "prefix_cache_hit_rate": "prefix_cache_hit_rate",
    "num_preemptions": "num_preemptions_total",
    "spec_draft_tokens": "spec_draft_tokens_total",
    "spec_accepted_tokens": "spec_accepted_tokens_total",
    "spec_acceptance_rate": "spec_acceptance_rate",
    "spec_mean_accepted_length": "spec_mean_accepted_length",
    "spec_draft_seconds": "spec_draft_seconds_total",
}


class ServerMetrics:
    """The server's counters and histograms; thread-safe.

    Examples
    --------
    >>> m = ServerMetrics()
    >>> m.inc("generation_tokens_total", 3)
    >>> m.observe("time_to_first_token_seconds", 0.02)
    >>> "tessera_generation_tokens_total 3" in m.render({})
    True
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, dict[Labels, float]] = {}
        self._histograms = {name: Histogram() for name, (kind, _) in METRICS.items() if kind == "histogram"}

    def inc(self, name: str, amount: float = 1, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._counters.setdefault(name, {})
            series[key] = series.get(key, 0) + amount

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self._histograms[name].observe(value)

    def value(self, name: str, **labels: str) -> float:
        """A counter's current value (0 if never incremented); for tests and the engine loop's bookkeeping."""
        with self._lock:
            return self._counters.get(name, {}).get(tuple(sorted(labels.items())), 0)

    def render(self, engine: Mapping[str, float]) -> str:
        """The Prometheus text exposition (format 0.0.4) of everything, with ``engine`` gauges (LLM.stats keys)."""
        gauges = {metric: engine[key] for key, metric in _ENGINE_GAUGES.items() if key in engine}
        if engine.get("kv_pages_total"):
            gauges["kv_cache_usage_ratio"] = engine["kv_pages_used"] / engine["kv_pages_total"]
        lines: list[str] = []
        with self._lock:
            for name, (kind, help_text) in METRICS.items():
                full = f"{PREFIX}_{name}"
                lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
                if kind == "histogram":
                    lines += self._histograms[name].lines(full)
                elif name in gauges:
                    lines.append(f"{full} {gauges[name]:.9g}")
                else:
                    series = self._counters.get(name) or {(): 0}
                    lines += [f"{full}{_labels(key)} {value:.9g}" for key, value in sorted(series.items())]
        return "\n".join(lines) + "\n"


def _labels(key: Labels) -> str:
    if not key:
        return ""
    escaped = (v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in key)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(key, escaped)) + "}"
