#!/usr/bin/env bash
# The demo: set up, then regenerate the 80 MT-Bench questions on the embedded CPU model with a
# throwaway Redis, a generate worker and Flower. Extra arguments go to `dflash-pipeline demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/dflash-pipeline demo "$@"
