#!/usr/bin/env bash
# The test suite: set up (chromium too, for the dashboard's browser tests, and .venv-sglang for
# the real-engine tests), run ruff and the type checker (mypy, strict: pyproject's [tool.mypy]),
# build the docs site strictly, then run pytest
# (tests start their own redis-server, moto S3 server and Celery workers;
# tests/test_compose_stack.py readies Docker with scripts/compose-local.sh and runs the compose
# stack itself, stopping only a dockerd it started). TEST_WORKERS (default
# 2) spreads the tests over that many pytest-xdist workers (0: all in this process); with one
# torch thread per process a single pytest leaves the second core idle. TEST_LOAD=2 adds a
# CPU-bound loop per core. Prints the 10 slowest tests, the wall time by test file and of the whole
# script (with the set-up's share and the load average). Extra arguments go to pytest.
#
# Both print the explicit Any count of common/, workers/, producer/ (scripts/any_count.py) and
# fail above scripts/any_ceiling.txt: it can only go down.
#
# --quick: the edit loop (a few minutes): ruff, mypy and the tests not marked e2e (no real
# workers, engines or compose stack), without the browser, SGLang venv or docs site set-up.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
if [ "${1:-}" = "--quick" ]; then
  shift
  bash scripts/setup.sh
  .venv/bin/ruff check .
  .venv/bin/mypy
  .venv/bin/python scripts/any_count.py   # the explicit Any: printed, never above its ceiling
  exec .venv/bin/python -m pytest -p no:cacheprovider -n "${TEST_WORKERS:-2}" --dist loadgroup \
    -m 'not e2e' "$@"
fi
bash scripts/setup.sh --browser --sglang
set_up=$((SECONDS - started))
# TEST_LOAD=N runs N CPU-bound loops beside the tests (2: one per core, the "busy cores" check);
# they stop with the script.
load_pids=()
for _ in $(seq 1 "${TEST_LOAD:-0}"); do
  python3 -c 'while True: pass' &
  load_pids+=("$!")
done
docs_site=$(mktemp -d)
trap 'rm -rf "$docs_site"; for pid in ${load_pids[@]+"${load_pids[@]}"}; do kill "$pid" 2>/dev/null || true; done' EXIT
.venv/bin/ruff check .
.venv/bin/mypy   # strict on common/, workers/ and producer/ (pyproject.toml's [tool.mypy])
.venv/bin/python scripts/any_count.py   # the explicit Any: printed, never above its ceiling
# The docs site, strictly (a broken link, a missing page or a failing generated reference fails
# the script), before pytest so that pytest's summary stays the last line of note.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$docs_site"
echo "scripts/test.sh: docs site built (mkdocs build --strict)"
rc=0
.venv/bin/python -m pytest -p no:cacheprovider -n "${TEST_WORKERS:-2}" --dist loadgroup \
  --durations=10 "$@" \
  || rc=$?
elapsed=$((SECONDS - started))
# The load average beside the figures: on the shared cores it says what the times mean.
printf 'scripts/test.sh: wall time %dm %02ds (set-up %dm %02ds, then ruff, mypy, the docs site and pytest); load %s\n' \
  $((elapsed / 60)) $((elapsed % 60)) $((set_up / 60)) $((set_up % 60)) \
  "$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo '?')"
exit "$rc"
