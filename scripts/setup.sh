#!/usr/bin/env bash
# Prepare a fresh Debian/Ubuntu machine with Python 3.11: redis-server, a venv with CPU torch
# and this package; with --browser also chromium and chromium-driver (the dashboard's browser
# tests; scripts/test.sh asks for them). Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
BROWSER=0; [ "${1:-}" = "--browser" ] && BROWSER=1

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

if ! command -v redis-server >/dev/null 2>&1; then
  echo "== installing redis-server"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
fi

if [ "$BROWSER" = 1 ] && ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1; then
  echo "== installing chromium and chromium-driver (browser tests)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  # Without apt (or root) the browser tests skip and say why; the rest of the set-up goes on.
  { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
      chromium chromium-driver >/dev/null; } || echo "!! could not install chromium"
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi

if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "== installing CPU torch"
  # The CPU index keeps pip from pulling a multi-GB CUDA build; --retries 0 keeps an offline
  # mirror (where that index is unreachable) from waiting on it.
  "$VENV/bin/pip" install -q --retries 0 torch==2.13.0 \
    --extra-index-url https://download.pytorch.org/whl/cpu
fi

stamp="$VENV/.dflash-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "== installing dflash-pipeline[dev]"
  "$VENV/bin/pip" install -q -e ".[dev]"
  touch "$stamp"
fi
