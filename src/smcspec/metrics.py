"""Prometheus metrics of the server (``GET /metrics``), on a registry of its own."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)


class ServerMetrics:
    """Request, token, latency, SMC and SD counters; running/waiting gauges; batch sizes."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.content_type = CONTENT_TYPE_LATEST
        self.requests = Counter(
            "smcspec_requests", "Requests by method and outcome", ["method", "outcome"], registry=r
        )
        self.prompt_tokens = Counter("smcspec_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "smcspec_generation_tokens", "Generated tokens", registry=r
        )
        self.ttft = Histogram(
            "smcspec_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY,
            registry=r,
        )
        self.max_gap = Histogram(
            "smcspec_max_token_gap_seconds",
            "Longest wait between two streamed tokens of a request, by method",
            ["method"],
            buckets=_LATENCY,
            registry=r,
        )
        self.method_ttft = Histogram(
            "smcspec_method_time_to_first_token_seconds",
            "Time to first token, by method",
            ["method"],
            buckets=_LATENCY,
            registry=r,
        )
        self.tpot = Histogram(
            "smcspec_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.rounds = Counter("smcspec_smc_rounds", "SMC-SD rounds", registry=r)
        self.resamples = Counter("smcspec_smc_resamples", "SMC-SD resampling events", registry=r)
        self.ess = Histogram(
            "smcspec_smc_mean_ess",
            "Mean effective sample size per request",
            buckets=(1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32),
            registry=r,
        )
        self.drafted = Counter("smcspec_sd_draft_tokens", "SD drafted tokens", registry=r)
        self.accepted = Counter("smcspec_sd_accepted_tokens", "SD accepted tokens", registry=r)
        self.running = Gauge("smcspec_running_requests", "Requests decoding", registry=r)
        self.waiting = Gauge("smcspec_waiting_requests", "Requests queued", registry=r)
        self.batch_requests = Histogram(
            "smcspec_batch_requests",
            "Requests that shared one scheduler step",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.forward_rows = Counter(
            "smcspec_forward_rows", "Token rows fed to forwards, by model", ["model"], registry=r
        )
        self.distinct_rows = Counter(
            "smcspec_forward_distinct_rows",
            "Token rows computed (distinct particle prefixes), by model",
            ["model"],
            registry=r,
        )
        self.max_batch = Gauge(
            "smcspec_max_batch_requests", "Most requests that have shared one step", registry=r
        )
        labels = ["model", "resource"]
        self.pool_capacity = Gauge(
            "smcspec_pool_capacity", "Size of each model's shared pool", labels, registry=r
        )
        self.pool_free = Gauge(
            "smcspec_pool_free", "Free in each model's shared pool", labels, registry=r
        )
        self.pool_reserved = Gauge(
            "smcspec_pool_reserved", "Reserved by admitted requests", labels, registry=r
        )
        self.pool_leases = Gauge(
            "smcspec_pool_leases", "Requests holding a lease on each model", ["model"], registry=r
        )

    def bind_scheduler(self, scheduler) -> None:
        """Gauges read from ``scheduler`` and its engine's pools at every scrape."""
        self.running.set_function(lambda: scheduler.num_running)
        self.waiting.set_function(lambda: scheduler.num_waiting)
        for role, pool in scheduler.engine.pools().items():
            self.pool_leases.labels(role).set_function(lambda p=pool: p.leases)
            for res, size in pool.capacity.items():
                self.pool_capacity.labels(role, res).set(size)
                self.pool_free.labels(role, res).set_function(lambda p=pool, k=res: p.free()[k])
                self.pool_reserved.labels(role, res).set_function(
                    lambda p=pool, k=res, n=size: n - p.free()[k]
                )

    def observe_step(self, stats) -> None:
        """Count one scheduler step: the requests it batched and the rows (and distinct
        rows) each model's forwards computed."""
        if stats.requests:
            self.batch_requests.observe(stats.requests)
            if stats.requests > self.max_batch._value.get():
                self.max_batch.set(stats.requests)
        for model, rows in stats.rows.items():
            self.forward_rows.labels(model).inc(rows)
        for model, rows in stats.distinct_rows.items():
            self.distinct_rows.labels(model).inc(rows)

    def observe_request(self, method: str, outcome: str, req, result, prompt_tokens: int) -> None:
        """Count one finished request: its outcome under the ``method`` it ran (greedy
        ``smc`` runs as ``sd``), tokens, time to first token and, when it produced a result,
        its time per output token and its decoder's own counters; per method, the time to
        first token and the longest gap between two streamed tokens
        (:meth:`~smcspec.decoding.smc.stats.SmcStats.observe` and the like)."""
        self.requests.labels(method, outcome).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(req.tokens)
        if req.first_token_s is not None:
            self.ttft.observe(req.first_token_s)
            self.method_ttft.labels(method).observe(req.first_token_s)
        if req.max_gap_s is not None:
            self.max_gap.labels(method).observe(req.max_gap_s)
        if result is None:
            return
        if result.new_tokens > 1 and req.first_token_s is not None:
            self.tpot.observe(
                max(0.0, result.seconds - req.first_token_s) / (result.new_tokens - 1)
            )
        result.decode_stats.observe(self)

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format (``/metrics``)."""
        return generate_latest(self.registry)
