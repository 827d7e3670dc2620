"""The S3 stand-in: moto's S3 server enforcing IAM, kept on a volume (MinIO cannot be had on
machines without an image registry).

``s3_server.py server DIR [--console-address ...] [--address :PORT]`` takes MinIO's command line,
so compose runs either image with the same command. Like MinIO:

- **Every call is authenticated and authorized** by moto's IAM from the first one on: the root
  identity is ``MINIO_ROOT_USER`` / ``MINIO_ROOT_PASSWORD`` (an IAM user allowed everything),
  and the bucket job creates one user per role with its policy through the stand-in ``mc``
  (docker/standins/mc), which speaks moto's IAM API with the root key.
- **A user's key is chosen by the admin** (MinIO's ``mc admin user add ALIAS KEY SECRET``): moto
  makes random keys, so an IAM ``CreateAccessKey`` call that carries the headers
  ``X-Dflash-Access-Key-Id`` and ``X-Dflash-Secret-Access-Key`` (signed with the rest of the
  request, and authorized by moto as the call itself) gets that key instead.
- ``/minio/health/live`` answers as MinIO's does; moto's own unauthenticated API
  (``/moto-api/``: reset, state dumps) is closed, so no service can bypass IAM through it.

moto keeps its state in memory; this saves S3 and IAM to ``DIR/moto-s3.pickle`` every few
seconds and on SIGTERM (a ``docker compose stop`` or ``down``) and loads them at start, so the
stack's data and users outlive its containers as MinIO's do. A crash loses at most the last
seconds. A stand-in for trying the stack on one machine, never for a deployment.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import pickle
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from moto import settings
from moto.backends import get_backend
from moto.core import DEFAULT_ACCOUNT_ID
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import make_server

SNAPSHOT = "moto-s3.pickle"
SAVE_EVERY_S = 2.0
SERVICES = ("s3", "iam")
ROOT_USER = "minio-root"   # the IAM user that holds MINIO_ROOT_USER's key
CHOSEN_ID, CHOSEN_SECRET = "HTTP_X_DFLASH_ACCESS_KEY_ID", "HTTP_X_DFLASH_SECRET_ACCESS_KEY"
log = logging.getLogger("s3-standin")

StartResponse = Callable[..., Any]


def _state() -> dict[str, dict[str, dict[str, object]]]:
    """Every account's S3 and IAM backends by region (partition), as moto holds them."""
    return {service: {account: dict(regions) for account, regions in get_backend(service).items()}
            for service in SERVICES}


def load(path: Path) -> None:
    """Restore the snapshot into moto's (empty) backends."""
    if not path.exists():
        return
    saved = pickle.loads(path.read_bytes())
    if not set(saved) <= set(SERVICES):   # an older snapshot: S3's accounts alone
        saved = {"s3": saved}
    for service, accounts in saved.items():
        backends = get_backend(service)
        for account, regions in accounts.items():
            for region, backend in regions.items():
                backends[account][region].__dict__.update(backend.__dict__)
    log.info("loaded %s from %s", ", ".join(sorted(saved)), path)


class Saver:
    """Writes the snapshot when it changed: write to a temporary file, then rename."""

    def __init__(self, path: Path) -> None:
        self.path, self.digest, self.lock = path, b"", threading.Lock()

    def save(self) -> None:
        with self.lock:
            for _ in range(5):   # a request thread may change a dict while it is pickled
                try:
                    data = pickle.dumps(_state())
                    break
                except RuntimeError:
                    continue
            else:
                return
            digest = hashlib.sha256(data).digest()
            if digest == self.digest:
                return
            tmp = self.path.with_suffix(".tmp")
            tmp.write_bytes(data)
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
            tmp.replace(self.path)
            self.digest = digest


def _iam(account: str = DEFAULT_ACCOUNT_ID) -> Any:
    return get_backend("iam")[account]["aws"]


def _owner_of(key_id: str) -> str | None:
    """The IAM user that holds ``key_id`` in the default account, else None."""
    user = _iam().get_user_from_access_key_id(key_id)
    return None if user is None else user.name


def set_key(key: Any, key_id: str, secret: str) -> None:
    """Give an access key moto made the id and secret the admin chose."""
    backend = _iam()
    backend.access_keys.pop(key.access_key_id, None)
    key.access_key_id, key.secret_access_key = key_id, secret
    backend.access_keys[key_id] = key


def ensure_root(key_id: str, secret: str) -> None:
    """The root identity: an IAM user allowed everything, holding exactly the root key."""
    backend = _iam()
    if ROOT_USER not in backend.users:
        backend.create_user("us-east-1", ROOT_USER)
        backend.put_user_policy(ROOT_USER, "all", '{"Version": "2012-10-17", "Statement": '
                                '[{"Effect": "Allow", "Action": "*", "Resource": "*"}]}')
    for key in list(backend.list_access_keys(ROOT_USER)):
        backend.delete_access_key(key.access_key_id, ROOT_USER)
    owner = _owner_of(key_id)
    if owner is not None:
        sys.exit(f"error: MINIO_ROOT_USER {key_id!r} is already the key of user {owner!r}")
    set_key(backend.create_access_key(ROOT_USER), key_id, secret)


class StandIn:
    """WSGI middleware in front of moto: MinIO's health path, moto's API closed, chosen keys."""

    def __init__(self, app: Callable[[dict[str, Any], StartResponse], Iterable[bytes]]) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path.startswith("/minio/health/"):
            start_response("200 OK", [("Content-Length", "0")])
            return [b""]
        if path.startswith("/moto-api"):
            return _error(start_response, "403 Forbidden", "the stand-in's moto API is closed")
        if CHOSEN_ID not in environ:
            return self.app(environ, start_response)
        return self._chosen_key(environ, start_response)

    def _chosen_key(self, environ: dict[str, Any], start_response: StartResponse
                    ) -> Iterable[bytes]:
        """CreateAccessKey as moto authorizes and runs it, then the chosen id and secret.

        A user that holds the chosen id already keeps that key, with the chosen secret (the
        bucket job runs at every start: its users' keys never vanish, even for a moment).
        """
        key_id, secret = environ[CHOSEN_ID], environ.get(CHOSEN_SECRET, "")
        if len(key_id) < 3 or len(secret) < 8:
            return _error(start_response, "400 Bad Request",
                          "an access key has 3 characters or more, its secret 8 or more")
        reply: dict[str, Any] = {}

        def keep(status: str, headers: list[tuple[str, str]], *_: Any) -> None:
            reply["status"], reply["headers"] = status, headers

        body = b"".join(self.app(environ, keep))
        made = re.search(rb"<AccessKeyId>([^<]+)</AccessKeyId>", body)
        if reply["status"].startswith("200") and b"CreateAccessKeyResponse" in body and made:
            backend, generated = _iam(), made.group(1).decode()
            key = backend.access_keys[generated]
            owner = _owner_of(key_id)
            if owner not in (None, key.user_name):
                backend.delete_access_key(generated, key.user_name)
                return _error(start_response, "409 Conflict", f"access key {key_id} is in use")
            if owner is None:
                set_key(key, key_id, secret)
            else:
                backend.access_keys[key_id].secret_access_key = secret
                backend.delete_access_key(generated, key.user_name)
            body = body.replace(generated.encode(), key_id.encode())
            body = re.sub(rb"<SecretAccessKey>[^<]*</SecretAccessKey>",
                          b"<SecretAccessKey>" + secret.encode() + b"</SecretAccessKey>", body)
            log.info("access key %s set for user %s", key_id, key.user_name)
        headers = [(k, str(len(body)) if k.lower() == "content-length" else v)
                   for k, v in reply["headers"]]
        start_response(reply["status"], headers)
        return [body]


def _error(start_response: StartResponse, status: str, message: str) -> list[bytes]:
    body = (f"<Error><Code>{status.split(' ', 1)[1].replace(' ', '')}</Code>"
            f"<Message>{message}</Message></Error>").encode()
    start_response(status, [("Content-Type", "application/xml"),
                            ("Content-Length", str(len(body)))])
    return [body]


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["server"])
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--address", default=":9000")
    parser.add_argument("--console-address", default="")   # MinIO's; no console here
    args = parser.parse_args()
    root_key = os.environ.get("MINIO_ROOT_USER", "minioadmin")
    root_secret = os.environ.get("MINIO_ROOT_PASSWORD", "minioadmin")
    os.umask(0o077)   # the snapshot holds every user's secret
    args.data_dir.mkdir(parents=True, exist_ok=True)
    path = args.data_dir / SNAPSHOT
    load(path)
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0   # IAM decides every call, the first one too
    ensure_root(root_key, root_secret)
    saver = Saver(path)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    app = StandIn(DomainDispatcherApplication(create_backend_app))
    server = make_server("0.0.0.0", int(args.address.rsplit(":", 1)[1]), app, True,
                         request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    log.info("S3 and IAM on %s (root key %s)", args.address, root_key)
    while not stop.wait(SAVE_EVERY_S):
        saver.save()
    saver.save()
    server.shutdown()
    log.info("saved to %s; stopped", path)


if __name__ == "__main__":
    main()
