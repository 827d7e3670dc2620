"""A per-shard lease in Redis, renewed by a heartbeat thread.

A redelivered shard (visibility timeout, ``resume`` after a crash) must not run twice at once:
the first worker to ``SET NX`` the lease owns the shard until it releases it or stops renewing
it for one TTL (a ``kill -9``). Storage stays correct without the lease (put-once writes, commit
dedup); the lease only keeps two workers from spending a GPU on the same samples.
"""

from __future__ import annotations

import logging
import threading

import redis

from common.errors import LeaseBusy, LeaseLost

log = logging.getLogger(__name__)

_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""


class Lease:
    """Context manager: acquire on enter (or raise :class:`LeaseBusy`), renew, release on exit."""

    def __init__(self, client: redis.Redis, key: str, owner: str, ttl: float) -> None:
        self.client, self.key, self.owner = client, key, owner
        self.ttl_ms = int(ttl * 1000)
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Lease:
        if not self.client.set(self.key, self.owner, nx=True, px=self.ttl_ms):
            holder = self.client.get(self.key)
            remaining = self.client.pttl(self.key)
            raise LeaseBusy(f"{self.key} held by {holder!r} for {max(remaining, 0) / 1000:.1f}s")
        self._thread = threading.Thread(target=self._beat, name=f"lease {self.key}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.client.eval(_RELEASE, 1, self.key, self.owner)
        except redis.RedisError as err:
            # The lease then simply expires after its TTL.
            log.warning("could not release lease %s: %s", self.key, err)

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    def check(self) -> None:
        """Raise :class:`LeaseLost` if another worker took the shard over."""
        if self._lost.is_set():
            raise LeaseLost(f"lease {self.key} was lost; another worker owns the shard")

    def _beat(self) -> None:
        # Three renewals per TTL: one missed beat never loses the lease.
        interval = self.ttl_ms / 3000
        while not self._stop.wait(interval):
            try:
                renewed = self.client.eval(_RENEW, 1, self.key, self.owner, self.ttl_ms)
            except redis.RedisError as err:
                # Redis down: nobody else can take the lease either; keep trying.
                log.warning("lease %s heartbeat failed: %s", self.key, err)
                continue
            if not renewed:
                log.error("lease %s lost to another owner", self.key)
                self._lost.set()
                return

