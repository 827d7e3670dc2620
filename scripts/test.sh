#!/usr/bin/env bash
# The test suite: set up (chromium too, for the dashboard's browser tests), then run pytest
# (tests start their own redis-server, moto S3 server and Celery workers) on TEST_WORKERS
# processes (pytest-xdist; default 2, 0 runs in this process). Prints the 10 slowest tests and
# the wall time of the whole script. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
bash scripts/setup.sh --browser
.venv/bin/ruff check .
rc=0
.venv/bin/python -m pytest -p no:cacheprovider -n "${TEST_WORKERS:-2}" --dist loadgroup \
  --durations=10 "$@" \
  || rc=$?
elapsed=$((SECONDS - started))
printf 'scripts/test.sh: wall time %dm %02ds (set-up, ruff and pytest)\n' \
  $((elapsed / 60)) $((elapsed % 60))
exit "$rc"
