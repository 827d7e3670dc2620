# Stand-in for python:3.11-slim where no image registry answers: Debian bookworm's Python 3.11
# in a venv on PATH (python, pip), built from the debootstrap base (scripts/compose-local.sh).
ARG DEBIAN_IMAGE=dflash-standin/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /usr/local/python
ENV PATH=/usr/local/python/bin:$PATH PYTHONUNBUFFERED=1
CMD ["python3"]
