"""Prometheus metrics of the server: requests, tokens, tau, batch sizes and per-phase latency.

Each server owns its own registry (several servers can live in one process, as in tests), and
`/metrics` renders it in the Prometheus text format.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TAU = (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12, 16)


class ServerMetrics:
    """The server's metrics (all names prefixed `jetspec_`)."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "jetspec_requests", "HTTP requests answered.", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter(
            "jetspec_prompt_tokens", "Prompt tokens of served requests.", registry=r
        )
        self.generated_tokens = Counter(
            "jetspec_generated_tokens",
            "Tokens decoded for served requests (a row a stop string cut may decode a few past "
            "it, which its answer leaves out).",
            registry=r,
        )
        self.tau = Histogram(
            "jetspec_tau",
            "Tokens committed per target forward (verification round), per request.",
            buckets=_TAU,
            registry=r,
        )
        self.phase_seconds = Histogram(
            "jetspec_phase_seconds",
            "Seconds per phase: queue (waiting for a batch), compile (new shape buckets), "
            "prefill, decode (per batch) and request (end to end, per request).",
            ["phase"],
            buckets=_SECONDS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "jetspec_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token.",
            buckets=_SECONDS,
            registry=r,
        )
        self.batch_size = Histogram(
            "jetspec_batch_size",
            "Requests per decoded batch when it starts (those joining later are counted by "
            "jetspec_joined_requests).",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.joined = Counter(
            "jetspec_joined_requests",
            "Requests that joined a running batch at a chunk boundary (continuous batching).",
            registry=r,
        )
        self.queue_depth = Gauge("jetspec_queue_depth", "Requests waiting.", registry=r)
        self.running = Gauge("jetspec_running_requests", "Requests being decoded.", registry=r)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
