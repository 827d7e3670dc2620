#!/usr/bin/env bash
# Prepare a fresh Debian/Ubuntu machine with Python 3.11: redis-server, a venv with CPU torch
# and this package (with its dev and docs extras); with --browser also chromium and
# chromium-driver (the dashboard's browser tests); with --sglang also .venv-sglang, the pinned
# SGLang release serving on CPU (the real-engine tests; scripts/test.sh asks for both).
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
BROWSER=0; SGLANG=0
for arg in "$@"; do
  case "$arg" in
    --browser) BROWSER=1 ;;
    --sglang) SGLANG=1 ;;
    *) echo "usage: scripts/setup.sh [--browser] [--sglang]" >&2; exit 2 ;;
  esac
done

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

# uv installs exactly what pip would (same pins) in a fraction of the time; it does not read
# pip's configuration, so the index, find-links and constraints set there are passed on, and it
# takes the best match over all indexes as pip does, and compiles bytecode at install as pip
# does (where PYTHONDONTWRITEBYTECODE is set, nothing else would: every process would compile
# torch and transformers afresh, measured 1.7x the suite's CPU time). Where uv cannot be had or
# fails, pip does the work.
uv_args=(--index-strategy unsafe-best-match --compile-bytecode)
while IFS= read -r line; do
  key=${line%%=*}; key=${key##*.}; value=${line#*=}; value=${value//\'/}
  for item in $value; do
    case "$key" in
      find-links) [ -e "${item#file://}" ] && uv_args+=(--find-links "$item") ;;
      index-url|extra-index-url)
        [ "${item#file://}" = "$item" ] || [ -e "${item#file://}" ] || continue
        uv_args+=("--$key" "$item") ;;
      constraint) [ -f "$item" ] && uv_args+=(--constraint "$item") ;;
    esac
  done
done < <("$VENV/bin/pip" config list 2>/dev/null || true)
uv_install() {
  { [ -x "$VENV/bin/uv" ] || "$VENV/bin/pip" install -q uv >/dev/null 2>&1; } &&
    "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" "${uv_args[@]}" "$@"
}

if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "== installing CPU torch"
  # The CPU index keeps the installer from pulling a multi-GB CUDA build; where that index is
  # unreachable (an offline mirror), the configured ones serve (pip: --retries 0, no waiting).
  cpu=(--extra-index-url https://download.pytorch.org/whl/cpu)
  uv_install torch==2.13.0 "${cpu[@]}" 2>/dev/null || uv_install torch==2.13.0 ||
    "$VENV/bin/pip" install -q --retries 0 torch==2.13.0 "${cpu[@]}"
fi

# The package with its test and docs extras (scripts/test.sh builds the docs site strictly);
# again whenever pyproject.toml changes, or the docs tools are missing from an older set-up.
stamp="$VENV/.dflash-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ ! -x "$VENV/bin/mkdocs" ]; then
  echo "== installing dflash-pipeline[dev,docs]"
  uv_install -e ".[dev,docs]" || "$VENV/bin/pip" install -q -e ".[dev,docs]"
  touch "$stamp"
fi

# The real SGLang in a venv of its own (PyPI's CUDA torch, which its torchvision needs; it runs
# on the CPU), every package at the version scripts/sglang/constraints.txt names; sglang and
# vllm come without their dependencies (the GPU kernels they would pull are not used on CPU).
SGLANG_VENV=${SGLANG_VENV:-.venv-sglang}
sglang_stamp="$SGLANG_VENV/.dflash-installed"
if [ "$SGLANG" = 1 ] && { [ ! -f "$sglang_stamp" ] ||
    [ scripts/sglang/constraints.txt -nt "$sglang_stamp" ]; }; then
  echo "== installing $(grep '^sglang==' scripts/sglang/constraints.txt) into $SGLANG_VENV"
  [ -x "$SGLANG_VENV/bin/python" ] || "$PYTHON" -m venv "$SGLANG_VENV"
  "$SGLANG_VENV/bin/pip" install -q -r scripts/sglang/requirements.txt \
    -c scripts/sglang/constraints.txt
  "$SGLANG_VENV/bin/pip" install -q --no-deps -c scripts/sglang/constraints.txt sglang vllm
  "$SGLANG_VENV/bin/python" -c "import sglang.launch_server" >/dev/null
  touch "$sglang_stamp"
fi
