"""Named exceptions shared by the producer and the workers, so callers catch what they mean."""


class DflashError(Exception):
    """Base class for every error this package raises on purpose."""


class ConfigError(DflashError):
    """A setting, option or environment variable has an unusable value."""


class StorageError(DflashError):
    """Storage could not be read or written after retries."""


class AlreadyExists(StorageError):
    """A put-once write found the key already written (S3 412 / local EEXIST)."""


class NotFound(StorageError):
    """The key does not exist in storage."""


class RunConfigMismatch(DflashError):
    """A run id is reused with a different frozen configuration."""


class InputError(DflashError):
    """The input file cannot be read at all (missing, unknown format)."""


class BadRow(DflashError):
    """One input row is unusable; the message is the reason reported to the user."""


class LeaseLost(DflashError):
    """Another worker now holds the shard lease; this one must stop touching the shard."""


class LeaseBusy(DflashError):
    """The shard is leased by a live worker; try again after the lease would expire."""


class EngineError(DflashError):
    """The generation engine failed a request."""


class ShuttingDown(DflashError):
    """The worker is stopping: the shard flushed its last part and goes back to the queue."""


class HiddenStateError(DflashError):
    """Extracted or stored hidden states are unusable (NaN/Inf, wrong shape, wrong token ids)."""


class RunPaused(DflashError):
    """The run is paused by its quality gates: no shard starts until ``resume --accept-gates``."""


class NothingToTrain(DflashError):
    """No row of a drafter training batch has enough supervised tokens for one DFlash block."""
