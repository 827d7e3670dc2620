"""The S3 stand-in: moto's S3 server, kept on a volume (MinIO cannot be had on machines
without an image registry).

``s3_server.py server DIR [--console-address ...] [--address :PORT]`` takes MinIO's command line,
so compose runs either image with the same command. moto keeps objects in memory; this saves
them to ``DIR/moto-s3.pickle`` every few seconds and on SIGTERM (a ``docker compose stop`` or
``down``) and loads them at start, so the stack's data outlives its containers as MinIO's does.
A crash loses at most the last seconds. moto checks no credentials: a stand-in for trying the
stack on one machine, never for a deployment.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import pickle
import signal
import threading
from pathlib import Path

from moto.backends import get_backend
from moto.server import ThreadedMotoServer

SNAPSHOT = "moto-s3.pickle"
SAVE_EVERY_S = 2.0
log = logging.getLogger("s3-standin")


def _state() -> dict[str, dict[str, object]]:
    """Every account's S3 backends by region, as moto holds them."""
    return {account: dict(regions) for account, regions in get_backend("s3").items()}


def load(path: Path) -> None:
    """Restore the snapshot into moto's (empty) backends."""
    if not path.exists():
        return
    saved = pickle.loads(path.read_bytes())
    backends = get_backend("s3")
    for account, regions in saved.items():
        for region, backend in regions.items():
            backends[account][region].__dict__.update(backend.__dict__)
    log.info("loaded %d account(s) from %s", len(saved), path)


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


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["server"])
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--address", default=":9000")
    parser.add_argument("--console-address", default="")   # MinIO's; no console here
    args = parser.parse_args()
    args.data_dir.mkdir(parents=True, exist_ok=True)
    path = args.data_dir / SNAPSHOT
    load(path)
    saver = Saver(path)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server = ThreadedMotoServer(ip_address="0.0.0.0", port=int(args.address.rsplit(":", 1)[1]))
    server.start()
    while not stop.wait(SAVE_EVERY_S):
        saver.save()
    saver.save()
    server.stop()
    log.info("saved to %s; stopped", path)


if __name__ == "__main__":
    main()
