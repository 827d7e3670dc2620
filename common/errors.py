"""Named exceptions shared by the producer and the workers, grouped by what a stage does with them.

A stage task retries a :class:`TransientError` with capped backoff (and parks the shard after
``DFLASH_MAX_DELIVERIES`` attempts), parks the shard at once on a :class:`PermanentError`, and
parks it on anything it did not expect (with the traceback in the log): nothing is dropped.
"""

from collections.abc import Sequence


class DflashError(Exception):
    """Base class for every error this package raises on purpose."""


class TransientError(DflashError):
    """Something outside the shard failed and may work on a later attempt: retry with backoff."""


class PermanentError(DflashError):
    """The shard cannot succeed as things are (settings, data, a bug): park it with the reason."""


class ConfigError(PermanentError):
    """A setting, option or environment variable has an unusable value."""


class StorageError(TransientError):
    """Storage could not be read or written after retries."""


class NotFound(StorageError):
    """The key does not exist in storage."""


class StorageRefused(PermanentError, StorageError):
    """Storage refused the request for good (S3 4xx: access denied, bad request, no bucket):
    permanent (the shard parks at once), yet still a ``StorageError`` to code that reads on."""


class RunConfigMismatch(PermanentError):
    """A run id is reused with a different frozen configuration."""


class InputError(PermanentError):
    """The input file cannot be read at all (missing, unknown format)."""


class BadRow(PermanentError):
    """One input row is unusable; the message is the reason reported to the user."""


class LeaseLost(DflashError):
    """Another worker now holds the shard lease; this one must stop touching the shard."""


class LeaseBusy(DflashError):
    """The shard is leased by a live worker; try again after the lease would expire."""


class EngineError(TransientError):
    """The generation engine failed a request."""


class ShuttingDown(DflashError):
    """The worker is stopping: the shard flushed its last part and goes back to the queue."""


class HiddenStateError(PermanentError):
    """Extracted or stored hidden states are unusable (NaN/Inf, wrong shape, wrong token ids)."""


class RunPaused(DflashError):
    """The run is paused by its quality gates: no shard starts until ``resume --accept-gates``."""


class NothingToTrain(DflashError):
    """No row of a drafter training batch has enough supervised tokens for one DFlash block."""


class NotReady(TransientError):
    """An upstream stage has not committed what this stage reads yet; try again later."""


class PlanDoesNotFit(ConfigError):
    """The run's target and drafter state do not fit this rank's GPU (the plan names the fix)."""


class RunNotFound(ConfigError):
    """The run has no ``run.json`` in this storage root."""


class DrafterMismatch(ConfigError):
    """A drafter does not fit the target: hidden size, target layers, vocabulary or mask token."""


class GroupLost(TransientError):
    """A collective of the data-parallel training group failed (a rank died, the network broke):
    the group stops, the shard is retried."""


class RankFailed(PermanentError):
    """A rank's own work failed (out of memory, a bug, bad data): the shard parks, its reason
    kept; ``failures`` are what the ranks shared (an out-of-memory one is retried)."""

    def __init__(self, message: str, failures: Sequence[object] = ()) -> None:
        super().__init__(message)
        self.failures = list(failures)


class MalformedName(PermanentError):
    """A key or Redis field does not have the form :mod:`common.keys` writes (a bug or a hand
    edit): named, never read as some other shard."""


class RequestRefused(DflashError):
    """The engine cannot answer one request (HTTP 4xx, or it cannot fit the server's context):
    that sample is rejected with ``reason``, its shard goes on."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class EngineRefusesAll(PermanentError):
    """Every request of a shard was refused by the engine (a setting it rejects): park the
    shard with the engine's message rather than store every sample as rejected."""


class OptionRefused(ConfigError):
    """An option value the engine would refuse on every request: refused at the command line
    (exit 2, like click's own usage errors)."""


class ForeignObject(PermanentError):
    """A stored object that is not a valid record of its key (too large, a compression bomb,
    not JSON, the wrong type): readers treat it as foreign (:mod:`common.reads`)."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{key}: {why}")
        self.key, self.why = key, why

    def __reduce__(self) -> tuple[type, tuple[str, str]]:   # picklable across processes
        return type(self), (self.key, self.why)


class SchemaMismatch(PermanentError):
    """A stored record carries a schema number this release does not read."""
