"""A shard lease in Redis (``redis.lock.Lock``), renewed by a heartbeat thread.

A redelivered shard (healing, ``resume`` after a crash) must not run twice at once: the first
worker to take the lock owns the shard until it releases it or stops renewing it for one TTL (a
``kill -9``). Storage stays correct without the lease (put-once writes, commit dedup); the lease
only keeps two workers from spending a GPU on the same samples. The lock's token is
``owner ttl_ms``, so ``status`` can tell a live lease (renewed every third of its TTL) from one
whose worker died.
"""

from __future__ import annotations

import logging
import threading

import redis
from redis.exceptions import LockError

from common.errors import LeaseBusy, LeaseLost
from common.queue.redis_keys import BEATS_PER_TTL, lease_token

log = logging.getLogger(__name__)

class Lease:
    """Context manager: acquire on enter (or raise :class:`LeaseBusy`), renew, release on exit."""

    def __init__(self, client: redis.Redis, key: str, owner: str, ttl: float) -> None:
        self.client, self.key, self.owner = client, key, owner
        self.ttl_ms = max(int(ttl * 1000), 1)
        self.token = lease_token(owner, self.ttl_ms)
        self.lock = client.lock(key, timeout=ttl, blocking=False, thread_local=False)
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Lease:
        if not self.lock.acquire(token=self.token):
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
            self.lock.release()
        except LockError:
            pass  # expired or taken over: nothing of ours to release
        except redis.RedisError as err:
            # The lease then simply expires after its TTL.
            log.warning("could not release lease %s: %s", self.key, err)

    @property
    def lost(self) -> bool:
        return self._lost is not None

    def check(self) -> None:
        """Raise :class:`LeaseLost` if another worker took the shard over."""
        if self._lost is not None:
            raise LeaseLost(self._lost)

    def _beat(self) -> None:
        interval = self.ttl_ms / 1000 / BEATS_PER_TTL
        while not self._stop.wait(interval):
            try:
                self.lock.reacquire()
                continue
            except LockError:
                pass
            except redis.RedisError as err:
                # Redis down: nobody else can take the lease either; keep trying.
                log.warning("lease %s heartbeat failed: %s", self.key, err)
                continue
            if not self._take_back():
                return

    def _take_back(self) -> bool:
        """After a failed renewal: re-take a lease Redis lost (wipe, expiry), or give up."""
        try:
            if self.lock.acquire(token=self.token):
                log.warning("lease %s had vanished from Redis (wiped or expired); re-taken",
                            self.key)
                return True
            holder = self.client.get(self.key)
        except redis.RedisError as err:
            log.warning("lease %s heartbeat failed: %s", self.key, err)
            return True
        self._lost = f"lease {self.key} was taken over by {holder!r}"
        log.error("%s; this worker stops touching the shard", self._lost)
        return False
