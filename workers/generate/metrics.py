"""Prometheus metrics of a worker's own progress, for dashboards beside Flower.

Set ``DFLASH_METRICS_PORT`` (0 = off) and scrape ``http://HOST:PORT/metrics``: samples, tokens
and parts written per run, samples rejected by the gates, engine requests, shards committed, the
engine's requests in flight, and with speculative decoding its algorithm, verify steps and mean
accept length. The endpoint has no auth, so it listens on 127.0.0.1 unless
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
# Speculative decoding (MTP): verify steps and the tokens they gave, the mean accept length
# (tokens / steps, SGLang's ratio) and the algorithm (value 1 on its label).
SPEC_STEPS = Counter("dflash_spec_verify_steps", "Engine verify steps of written turns", ["run"])
SPEC_TOKENS = Counter("dflash_spec_output_tokens", "Output tokens of verified turns", ["run"])
ACCEPT_LENGTH = Gauge("dflash_spec_accept_length",
                      "Mean tokens per verify step of this worker's written turns", ["run"])
ALGORITHM = Gauge("dflash_spec_algorithm", "The engine's speculative algorithm", ["algorithm"])


def serve(host: str, port: int, in_flight: Callable[[], float]) -> None:
    """Expose the metrics on ``host:port``; ``in_flight`` is read at every scrape."""
    IN_FLIGHT.set_function(in_flight)
    start_http_server(port, addr=host)
    log.info("metrics on %s:%d/metrics", host, port)
