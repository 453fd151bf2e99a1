# Redis from Debian's redis-server package, on a base image of your own: for sites that build
# every image from their own Debian base instead of pulling redis:7.4 (docs/deploy.md,
# "Air-gapped builds"). It keeps the official image's contract that compose.yaml relies on: a
# `redis` user that owns /data, and redis-server and redis-cli on the PATH.
#   docker compose -f compose.yaml -f docker/compose.redis-debian.yaml build redis
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data && chown redis:redis /data
USER redis
WORKDIR /data
VOLUME /data
EXPOSE 6379
CMD ["redis-server", "--dir", "/data"]
