"""The process exit codes of every command, as the command reference documents them (binding;
docs/reference/cli.md, "Exit codes").

The only module that defines an ``EXIT_*`` code: producer, stages and benchmarks import them
from here (it imports nothing, so any module may).
"""

EXIT_OK = 0
EXIT_FAILURE = 1
"""Unreachable Redis or storage, missing input, a bad option value, a failed check."""
EXIT_USAGE = 2
"""Bad usage: click's own code for a ``UsageError`` (unknown option, missing argument), and an
option value the engine would refuse on every request (``--top-k 0``)."""
EXIT_REJECTED = 3
"""``enqueue`` (or its ``--dry-run``) finished but rejected some rows."""
EXIT_MISMATCH = 4
"""The run id already exists with a different configuration."""
