"""Prometheus metrics of one server (GET /metrics, the text exposition format).

The metrics live on the server's own `CollectorRegistry`: the process-global one would also
export whatever else registered there, and two apps in one process (the in-process tests)
would collide on the names. Engine gauges (queue depth, running and waiting sequences,
alive, KV pages) are read
when scraped, so they are never stale; counters and histograms are fed as requests are served
(`nanoqwen.server.middleware`).

Latencies are taken on the event loop, where a delta becomes a response chunk: what a client
can see, less the network. The histogram buckets run from half a millisecond (a GPU decode
step) to minutes (a long generation on the CPU reference backend), so one dashboard serves
both backends.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the format generate_latest writes

# Seconds. Inter-token latency: a decode step (GPU ~ms, CPU tens of ms) up to a stall.
ITL_BUCKETS = (
    0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5,
)  # fmt: skip
# Time to first token and queue wait: a prefill up to a long wait behind other requests.
TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
)  # fmt: skip
# Whole requests: an info route's microseconds up to a long generation.
DURATION_BUCKETS = (
    0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    600.0,
)  # fmt: skip


class Metrics:
    """The metric families of one server, reading the engine state from `worker` and `llm`."""

    def __init__(self, worker: Any, llm: Any) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "nanoqwen_http_requests",
            "HTTP requests answered, by method, route template and status",
            ["method", "route", "status"],
            registry=r,
        )
        self.request_duration = Histogram(
            "nanoqwen_http_request_duration_seconds",
            "Request arrival to the end of its response, by route template",
            ["route"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "nanoqwen_prompt_tokens", "Prompt tokens prefilled", registry=r
        )
        self.generation_tokens = Counter(
            "nanoqwen_generation_tokens", "Tokens generated", registry=r
        )
        self.time_to_first_token = Histogram(
            "nanoqwen_time_to_first_token_seconds",
            "Request arrival to its first generated token (queue wait and prefill included)",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "nanoqwen_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "nanoqwen_queue_wait_seconds",
            "Time a generation waited in the queue before the engine took it",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        gauges = {
            "nanoqwen_queue_depth": ("Requests waiting for the engine", lambda: worker.queue_depth),
            "nanoqwen_engine_running": (
                "Generations taken from the queue and not ended (admitted or preempted)",
                lambda: worker.running,
            ),
            "nanoqwen_sequences_running": (
                "Sequences admitted to the batch (prefilling or decoding)",
                lambda: worker.scheduled[0],
            ),
            "nanoqwen_sequences_waiting": (
                "Sequences taken from the queue but not admitted (no free pages, or preempted)",
                lambda: worker.scheduled[1],
            ),
            "nanoqwen_engine_alive": (
                "1 while the engine takes work; 0 after a fatal error or once shutdown begins",
                lambda: int(worker.alive),
            ),
            "nanoqwen_kv_pages_in_use": ("KV cache pages held", lambda: llm.kv_pages_in_use),
        }
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=r).set_function(read)
        r.register(SchedulerCollector(worker))
        r.register(PrefixCacheCollector(llm))
        r.register(SpeculationCollector(llm))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SchedulerCollector:
    """The scheduler's counters since the start: sequences preempted (pages released,
    recomputed later) and sequences moved between solo decoding and the batch (each move
    closes one loop and prefills the sequence's last partial page in the other)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def collect(self):
        _, _, preemptions, moves = self.worker.scheduled
        family = CounterMetricFamily(
            "nanoqwen_preemptions", "Sequences preempted when the KV pool ran out"
        )
        family.add_metric([], preemptions)
        yield family
        family = CounterMetricFamily(
            "nanoqwen_solo_moves",
            "Sequences moved from solo decoding into the batch, or back (nanoqwen.batching)",
        )
        family.add_metric([], moves)
        yield family


class PrefixCacheCollector:
    """The KV pool and the prefix cache, read from the engine's block manager when scraped
    (nanoqwen.kv_pages.KVStats: its counts are cumulative, so they export as counters). The
    hit rate is hit_tokens / lookup_tokens over any window."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def collect(self):
        stats = self.llm.kv_stats
        if stats is None:  # the engine is closed
            return
        cached = GaugeMetricFamily(
            "nanoqwen_kv_pages_cached", "KV pages held by no one but findable in the prefix cache"
        )
        cached.add_metric([], stats.cached)
        yield cached
        total = GaugeMetricFamily("nanoqwen_kv_pages", "KV pages in the pool")
        total.add_metric([], stats.pages)
        yield total
        for name, doc, value in (
            ("nanoqwen_prefix_cache_lookup_tokens", "Prompt tokens looked up", stats.lookup_tokens),
            ("nanoqwen_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
             stats.hit_tokens),
            ("nanoqwen_kv_page_evictions", "Cached KV pages taken back for new K/V",
             stats.evictions),
        ):  # fmt: skip
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            yield family


class SpeculationCollector:
    """Speculative decoding's counters, read from `llm.spec_totals` (nanoqwen.llm) when
    scraped: draft tokens verified, accepted, and decode steps. accepted / drafted is the
    acceptance rate, 1 + accepted / steps the tokens a step, over any window. All stay 0 while
    speculation is off."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def collect(self):
        totals = self.llm.spec_totals
        for name, doc, value in (
            ("nanoqwen_spec_drafted_tokens", "Draft tokens verified by speculative decoding",
             totals.drafted),
            ("nanoqwen_spec_accepted_tokens", "Draft tokens accepted", totals.accepted),
            ("nanoqwen_spec_steps", "Decode steps of speculative generations", totals.steps),
        ):  # fmt: skip
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            yield family
