"""The dashboard's aiohttp app: two pages, static files and the JSON API behind every panel.

``/`` lists the runs, ``/runs/<run>`` is one run's page; ``/api/runs``,
``/api/runs/<run>/status`` (exactly ``status --json``), ``.../series`` (``?live=1``: with
uncommitted parts), ``.../shards``, ``.../engines``, ``.../gates`` and ``.../evals`` (the newest
stored ``eval-drafter --dataset`` table) feed them. With ``auth``
(``user:password``) every request needs HTTP basic auth. Start it with ``dflash-pipeline ui``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import ipaddress
import json
import logging
import re
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from common import keys
from common.config import UiSettings
from common.engine.speculative import SpeculativeFigures
from common.errors import DflashError, NotFound, RunNotFound
from common.runs.schemas import EngineRecord
from producer.ui.views import Views

log = logging.getLogger(__name__)

STATIC = Path(__file__).resolve().parent / "static"
PROBE_TIMEOUT_S = 5.0   # SGLang's /health runs a one-token generation: 1 s or more
_GAUGE = re.compile(r"^(sglang:num_running_reqs|sglang:num_queue_reqs)(?:\{[^}]*\})?\s+(\S+)",
                    re.MULTILINE)
VIEWS: web.AppKey[Views] = web.AppKey("views", Views)
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
NETWORKS: web.AppKey[list[IPNetwork]] = web.AppKey("engine_networks", list)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
LIVE = ("1", "true", "yes")   # ?live=...: the series reads uncommitted parts too


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(obj, sort_keys=True), status=status,
                        content_type="application/json")


def basic_auth(auth: str) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """Middleware: 401 unless the request carries ``auth`` (user:password) as basic auth."""
    expected = auth.encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        header = request.headers.get("Authorization", "")
        scheme, _, value = header.partition(" ")
        try:
            given = base64.b64decode(value.strip(), validate=True)
        except (binascii.Error, ValueError):
            given = b""
        if scheme.lower() != "basic" or not hmac.compare_digest(given, expected):
            return web.Response(status=401, text="authentication required",
                                headers={"WWW-Authenticate": 'Basic realm="dflash-pipeline"'})
        return await handler(request)

    return check


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Our errors as JSON: an unknown run is a 404, storage trouble a 503."""
    try:
        return await handler(request)
    except (NotFound, RunNotFound) as exc:
        return _json({"error": str(exc)}, 404)
    except (DflashError, OSError) as exc:
        log.warning("%s: %s", request.path, exc)
        return _json({"error": f"{type(exc).__name__}: {exc}"}, 503)


def _view(method: str) -> Handler:
    async def handle(request: web.Request) -> web.Response:
        views = request.app[VIEWS]
        return _json(await asyncio.to_thread(getattr(views, method), request.match_info["run"]))

    return handle


async def series(request: web.Request) -> web.Response:
    """The series panel: committed shards, with uncommitted parts asked by ``?live=1``."""
    live = request.query.get("live", "") in LIVE
    run = request.match_info["run"]
    return _json(await asyncio.to_thread(request.app[VIEWS].series, run, live))


def panel(name: str, handler: Handler) -> Handler:
    """``handler`` with its failure answered as this panel's own error (JSON naming the panel:
    503 for storage or Redis trouble, 500 for anything else), never the page's: the other
    panels of a refresh answer as usual. An unknown run stays a 404."""
    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except (NotFound, RunNotFound):
            raise
        except Exception as exc:  # noqa: BLE001 - a bug or a forged object: this panel's answer
            known = isinstance(exc, DflashError | OSError)
            log.log(logging.WARNING if known else logging.ERROR, "%s: %s: %s", request.path,
                    type(exc).__name__, exc, exc_info=not known)
            return _json({"panel": name, "error": f"{type(exc).__name__}: {exc}"[:1000]},
                         503 if known else 500)

    return handle


async def run_list(request: web.Request) -> web.Response:
    return _json({"runs": await asyncio.to_thread(request.app[VIEWS].run_list)})


async def engines(request: web.Request) -> web.Response:
    """Each engine the workers announced: URL, healthy or not, requests running and queued, its
    speculative algorithm and the run's mean accept length on it. Only URLs of the allowed
    networks are probed (anyone who can write Redis announces them), never past a redirect."""
    views = request.app[VIEWS]
    run = request.match_info["run"]
    status = await asyncio.to_thread(views.recent_status, run)
    found = status["engines"]
    timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
    networks = request.app[NETWORKS]
    engines = sorted((found or {}).items())
    async with aiohttp.ClientSession(timeout=timeout) as session:
        probes = await asyncio.gather(*(_probe(session, e["url"], networks)
                                        for _, e in engines))
    spec = status.get("speculative") or {}
    rows = [{"name": name, **{k: engine.get(k) for k in ("url", "log", "pid", "worker")},
             **_speculative(engine, spec), **probe}
            for (name, engine), probe in zip(engines, probes, strict=True)]
    return _json({"run": run, "redis": found is not None, "engines": rows})


def _speculative(engine: EngineRecord,
                 by_worker: dict[str, SpeculativeFigures]) -> dict[str, str | float | None]:
    """The engine's speculative algorithm and this run's mean accept length on its worker."""
    mine = by_worker.get(engine.get("worker") or "")
    return {"algorithm": engine.get("algorithm") or (mine["algorithm"] if mine else None),
            "accept_length": mine["accept_length"] if mine else None}


async def admitted(url: str, networks: list[IPNetwork]) -> str | None:
    """Why ``url`` may not be fetched (None: it may): an http(s) URL whose host resolves only to
    addresses of ``networks``."""
    try:
        parts = urllib.parse.urlsplit(str(url))
        port = parts.port
    except ValueError as exc:
        return f"not a URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "not an http(s) URL"
    try:
        found = await asyncio.get_running_loop().getaddrinfo(parts.hostname, port or 80)
    except OSError as exc:
        return f"{parts.hostname} does not resolve ({exc})"
    addresses = {ipaddress.ip_address(info[4][0]) for info in found}
    outside = sorted(str(a) for a in addresses if not any(a in n for n in networks))
    return f"{parts.hostname} is outside the engine networks ({', '.join(outside)})" \
        if outside else None


def engine_networks(spec: str) -> list[IPNetwork]:
    """The ``ui_engine_networks`` setting as networks."""
    return [ipaddress.ip_network(part.strip(), strict=False) for part in spec.split(",")
            if part.strip()]


async def _probe(session: aiohttp.ClientSession, url: str,
                 networks: list[IPNetwork]) -> dict[str, Any]:
    result: dict[str, Any] = {"healthy": False, "running": None, "queued": None}
    refused = await admitted(url, networks)
    if refused is not None:
        return {**result, "error": f"not probed: {refused}"}
    try:
        async with session.get(f"{url}/health", allow_redirects=False) as response:
            result["healthy"] = response.status == 200
        async with session.get(f"{url}/metrics", allow_redirects=False) as response:
            if response.status == 200:
                for name, value in _GAUGE.findall(await response.text()):
                    result["running" if name.endswith("running_reqs") else "queued"] = \
                        int(float(value))
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        result["error"] = str(exc) or type(exc).__name__
    return result


async def run_page(request: web.Request) -> web.StreamResponse:
    run = request.match_info["run"]
    views = request.app[VIEWS]
    known = keys.valid_run_id(run) and await asyncio.to_thread(
        views.storage.exists, keys.run_config(run))
    if not known:
        return web.Response(status=404, text=f"run {run!r} not found in {views.storage.root}")
    return web.FileResponse(STATIC / "run.html")


async def index_page(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC / "index.html")


def make_app(views: Views, auth: str = "",
             networks: str = UiSettings.engine_networks) -> web.Application:
    """The dashboard app over ``views``; ``auth`` (user:password) turns basic auth on;
    ``networks``: where engine URLs may point (the ``ui_engine_networks`` setting)."""
    middlewares: list[Any] = [basic_auth(auth)] if auth else []
    app = web.Application(middlewares=[*middlewares, errors])
    app[VIEWS] = views
    app[NETWORKS] = engine_networks(networks)
    app.router.add_get("/", index_page)
    app.router.add_get("/runs/{run}", run_page)
    app.router.add_get("/api/runs", run_list)
    for name in ("status", "shards", "gates", "evals"):
        app.router.add_get(f"/api/runs/{{run}}/{name}", panel(name, _view(name)))
    app.router.add_get("/api/runs/{run}/series", panel("series", series))
    app.router.add_get("/api/runs/{run}/engines", panel("engines", engines))
    app.router.add_static("/static/", STATIC)
    return app
