"""The server's Prometheus metrics (`GET /metrics`), in a registry of their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from core.generation.slots import Engine


class Metrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("apps_requests", "Requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.latency = Histogram("apps_request_seconds", "Request latency", ["endpoint"], registry=r)
        self.batch = Histogram(
            "apps_batch_requests", "Requests per predict call", ["model"], buckets=(1, 2, 4, 8, 16, 32, 64), registry=r
        )
        self.slots = Histogram(
            "apps_decode_slots", "Active slots per decode step", ["model"], buckets=(1, 2, 4, 8, 16, 32, 64), registry=r
        )
        self.queue = Gauge("apps_queue_depth", "Requests waiting", ["model"], registry=r)
        self.tokens = Counter("apps_generated_tokens", "Tokens generated", ["model"], registry=r)
        self.first_token = Histogram(
            "apps_time_to_first_token_seconds", "Time to the first token", ["model"], registry=r
        )
        self.busy = Gauge("apps_busy_slots", "Generation slots in use", ["model"], registry=r)
        self.prefills = Gauge("apps_prefills", "Requests prefilled into a slot so far", ["model"], registry=r)
        self.reused = Gauge(
            "apps_prompt_tokens_reused", "Prompt tokens read from kept prompts, not prefilled", ["model"], registry=r
        )

    def watch(self, name: str, engine: Engine, adapter: int = 0) -> None:
        """Reads the generation engine of the language model `name` (its `adapter`, where LoRA
        runs share the engine): its slots in use at each scrape; the engine's batch at each step
        (under the name of its base, adapter 0, or of its first run)."""
        self.busy.labels(name).set_function(lambda: engine.busy(adapter))
        self.prefills.labels(name).set_function(lambda: engine.prefills)
        if engine.on_step is None:
            engine.on_step = self.slots.labels(name).observe
            self.reused.labels(name).set_function(lambda: engine.reused)
