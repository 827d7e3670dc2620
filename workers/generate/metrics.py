"""Prometheus metrics of a worker's own progress, for dashboards beside Flower.

Set ``DFLASH_METRICS_PORT`` (0 = off) and scrape ``http://HOST:PORT/metrics``: samples, tokens
and parts written per run, samples rejected by the gates, engine requests, shards committed, and
the engine's requests in flight. The endpoint has no auth, so it listens on 127.0.0.1 unless
``DFLASH_METRICS_HOST`` names another address (0.0.0.0 for a Prometheus on the same private
network, as compose's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import Counter, Gauge, start_http_server

log = logging.getLogger(__name__)

SAMPLES = Counter("dflash_samples_generated", "Samples written to parts", ["run"])
TOKENS = Counter("dflash_output_tokens_generated", "Output tokens in written samples", ["run"])
REJECTED = Counter("dflash_samples_rejected", "Samples rejected by the quality gates", ["run"])
PARTS = Counter("dflash_parts_written", "Part objects written", ["run"])
REQUESTS = Counter("dflash_engine_requests", "Requests sent to the engine", ["run"])
COMMITS = Counter("dflash_shards_committed", "Shards committed by this worker", ["run"])
IN_FLIGHT = Gauge("dflash_engine_in_flight", "Engine requests in flight now")


def serve(host: str, port: int, in_flight: Callable[[], float]) -> None:
    """Expose the metrics on ``host:port``; ``in_flight`` is read at every scrape."""
    IN_FLIGHT.set_function(in_flight)
    start_http_server(port, addr=host)
    log.info("metrics on %s:%d/metrics", host, port)
