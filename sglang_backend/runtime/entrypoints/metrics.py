"""Prometheus metrics: request latencies observed in the HTTP process, engine gauges read from the
scheduler at scrape time."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        p = "sglang_backend_"
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token", registry=r, buckets=LATENCY_BUCKETS)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Time per output token after the first", registry=r,
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "End-to-end request latency", registry=r, buckets=LATENCY_BUCKETS)
        self.requests = Counter(p + "requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens of finished requests", registry=r)
        self.cached_tokens = Counter(p + "cached_tokens", "Prompt tokens served from the radix cache", registry=r)
        self.num_running = Gauge(p + "num_running_reqs", "Requests in the running batch", registry=r)
        self.num_queued = Gauge(p + "num_queue_reqs", "Requests waiting to be scheduled", registry=r)
        self.token_usage = Gauge(p + "token_usage", "Fraction of the KV pool held by running requests", registry=r)
        self.cache_hit_rate = Gauge(p + "cache_hit_rate", "Prompt tokens served from cache / prompt tokens", registry=r)
        self.gen_throughput = Gauge(p + "gen_throughput", "Generated tokens/s since the previous scrape", registry=r)
        self.session_pinned_tokens = Gauge(p + "session_pinned_tokens", "KV tokens session pins hold", registry=r)
        self.session_reused_tokens = Gauge(p + "session_reused_tokens", "Cached prompt tokens of requests that found "
                                           "their session's pin (re-prefill avoided), since start", registry=r)
        self.kv_host_used_tokens = Gauge(p + "kv_host_used_tokens", "KV tokens the host tier holds", registry=r)
        self.kv_host_loaded_tokens = Gauge(p + "kv_host_loaded_tokens", "KV tokens copied back from the host tier "
                                           "instead of computed again (re-prefill avoided), since start", registry=r)
        self.kv_host_written_tokens = Gauge(p + "kv_host_written_tokens", "KV tokens evicted from the pool into the "
                                            "host tier, since start", registry=r)
        self._last = None

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_finished(self, state) -> None:
        now = time.monotonic()
        meta = state.meta
        completion = int(meta.get("completion_tokens", 0))
        self.e2e.observe(now - state.created)
        if state.first_token_time is not None and completion > 1:
            self.tpot.observe((now - state.first_token_time) / (completion - 1))
        self.prompt_tokens.inc(int(meta.get("prompt_tokens", 0)))
        self.generation_tokens.inc(completion)
        self.cached_tokens.inc(int(meta.get("cached_tokens", 0)))

    def observe_reason(self, reason: str) -> None:
        self.requests.labels(finish_reason=reason).inc()

    def render(self, stats: dict | None) -> bytes:
        if stats:
            self.num_running.set(stats["num_running"])
            self.num_queued.set(stats["num_waiting"])
            total = stats["max_total_num_tokens"]
            reclaimable = stats["free_tokens"] + stats["evictable_tokens"] + stats.get("session_pinned_tokens", 0)
            self.token_usage.set(1 - reclaimable / total)
            self.cache_hit_rate.set(stats["cache_hit_rate"])
            if "session_pinned_tokens" in stats:  # absent with session pins off
                self.session_pinned_tokens.set(stats["session_pinned_tokens"])
                self.session_reused_tokens.set(stats["session_reused_tokens"])
            if "kv_host_used_tokens" in stats:  # absent without a host tier
                self.kv_host_used_tokens.set(stats["kv_host_used_tokens"])
                self.kv_host_loaded_tokens.set(stats["kv_host_loaded_tokens"])
                self.kv_host_written_tokens.set(stats["kv_host_written_tokens"])
            now = time.monotonic()
            if self._last is not None and now > self._last[0]:
                self.gen_throughput.set((stats["num_generated_tokens"] - self._last[1]) / (now - self._last[0]))
            self._last = (now, stats["num_generated_tokens"])
        return generate_latest(self.registry)
