#!/usr/bin/env bash
# The test suite: set up (chromium too, for the dashboard's browser tests), then run pytest
# (tests start their own redis-server, moto S3 server and Celery workers). TEST_WORKERS=2 spreads
# the tests over two pytest-xdist workers; the default, 0, runs them in this process (on 2 busy
# cores two workers measured no faster: README, Tests). Prints the 10 slowest tests and the wall
# time of the whole script. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
bash scripts/setup.sh --browser
.venv/bin/ruff check .
rc=0
.venv/bin/python -m pytest -p no:cacheprovider -n "${TEST_WORKERS:-0}" --dist loadgroup \
  --durations=10 "$@" \
  || rc=$?
elapsed=$((SECONDS - started))
printf 'scripts/test.sh: wall time %dm %02ds (set-up, ruff and pytest)\n' \
  $((elapsed / 60)) $((elapsed % 60))
exit "$rc"
