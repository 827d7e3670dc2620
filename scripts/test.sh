#!/usr/bin/env bash
# The test suite: set up (chromium too, for the dashboard's browser tests), then run pytest
# (tests start their own redis-server, moto S3 server and Celery workers). Extra arguments go
# to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --browser
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
