"""``dflash-pipeline ui [--host 127.0.0.1] [--port 8700]``: serve the run dashboard.

Basic auth from ``DFLASH_UI_AUTH=user:password`` (as Flower's); a host other than loopback is
refused without it, and a password that is still .env.example's placeholder always. Works with
Redis down (the live figures read as unknown).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Any

import click

from common.cli import options_for
from common.config import Settings, env_name
from common.errors import ConfigError

PLACEHOLDER = "change-me-"
"""How .env.example's passwords begin: a dashboard is never served behind one."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_auth(host: str, auth: str) -> None:
    """Refuse a bad ``user:password`` and a non-loopback host without one."""
    if auth:
        user, sep, password = auth.partition(":")
        if not (user and sep and password):
            raise ConfigError(f"{env_name('ui_auth')} must be user:password")
        if password.startswith(PLACEHOLDER):
            raise ConfigError(f"{env_name('ui_auth')}'s password is still .env.example's "
                              f"placeholder ({PLACEHOLDER}...): set a password of your own "
                              "(UI_PASSWORD in compose's .env)")
    elif not is_loopback(host):
        raise ConfigError(f"refusing to serve the dashboard on {host} without auth: set "
                          f"{env_name('ui_auth')}=user:password, or use --host 127.0.0.1")


def ui_command(common_options: Callable[[Callable[..., Any]], Callable[..., Any]]
               ) -> click.Command:
    """The ``ui`` command, wrapped in the CLI's shared --storage/--broker-url options."""

    @click.command("ui")
    @options_for("ui")
    @common_options
    def ui(settings: Settings, host: str, port: int) -> None:
        """Serve the run dashboard: progress, throughput, ETA, engines, gates, training."""
        check_auth(host, settings.ui.auth)
        import redis
        from aiohttp import web

        from common.storage import open_storage
        from producer.ui.server import make_app
        from producer.ui.views import Views

        client = redis.Redis.from_url(settings.broker.url, decode_responses=True,
                                      socket_timeout=5, socket_connect_timeout=2)
        views = Views(open_storage(settings.broker.storage, settings.read), client)
        shown = "localhost" if host in ("0.0.0.0", "::") else host
        click.echo(f"dashboard: http://{shown}:{port}/  (storage {settings.broker.storage}, broker "
                   f"{settings.masked_broker_url}"
                   + (", basic auth on)" if settings.ui.auth else ", no auth)"))
        web.run_app(make_app(views, settings.ui.auth, settings.ui.engine_networks), host=host,
                    port=port, print=None, access_log=None)

    return ui
