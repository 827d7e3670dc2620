# Stand-in for redis:7.2-alpine where no image registry answers: Debian bookworm's redis-server
# (7.0) and redis-cli, run as the redis user with its data in /data like the upstream image.
ARG DEBIAN_IMAGE=dflash-standin/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data && chown redis:redis /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server"]
