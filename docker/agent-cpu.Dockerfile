# syntax=docker/dockerfile:1
# meshd-agent image for CPU agents (--device cpu): plain Debian 12, meshd's own
# binaries and the Debian libraries they link, no CUDA. Compose's default
# agents run it; docker/agent.Dockerfile is the one for GPUs. Build from the
# repository root:
#   docker build -f docker/agent-cpu.Dockerfile -t meshd-agent-cpu .

# --- build: the same packages as .ci/install-deps (Debian 12) ---------------
FROM debian:bookworm AS build
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      build-essential cmake pkg-config \
      libgrpc-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler \
      libcurl4-openssl-dev libmicrohttpd-dev uthash-dev libopenblas-dev libjson-c-dev \
      libssl-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN rm -rf build \
 && cmake -S . -B build -DMESHD_BUILD_TESTS=OFF -DMESHD_WITH_CUDA=OFF \
 && cmake --build build -j"$(nproc)" --target meshd-agent meshctl

# --- runtime ------------------------------------------------------------------
FROM debian:bookworm-slim
ARG DEBIAN_FRONTEND=noninteractive
# Exactly the libraries the binaries link (readelf -d: NEEDED), by package.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      libgrpc29 libprotobuf-c1 libcurl4 libmicrohttpd12 libopenblas0-pthread libjson-c5 libssl3 \
      ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 meshd \
 && useradd --system --uid 10001 --gid meshd --no-create-home --home-dir /tmp \
      --shell /usr/sbin/nologin meshd
COPY --from=build /src/build/bin/meshd-agent /src/build/bin/meshctl /usr/local/bin/
# Runs as uid/gid 10001 and writes nothing outside /tmp (a tmpfs or emptyDir
# where the root filesystem is read-only: compose read_only, k8s
# readOnlyRootFilesystem).
USER 10001:10001
WORKDIR /tmp
ENV MESHD_LISTEN=0.0.0.0:50052 \
    MESHD_HEALTH_LISTEN=0.0.0.0:8081 \
    MESHD_DEVICE=cpu \
    HOME=/tmp \
    TMPDIR=/tmp
# 50052: the Agent service (cluster mTLS with MESHD_CLUSTER_CA/CERT/KEY). 8081:
# grpc.health.v1 alone, in plaintext, for probes and the HEALTHCHECK. 9091:
# /metrics where MESHD_METRICS_LISTEN puts it.
EXPOSE 50052 8081 9091
# Liveness only: "" (accepting calls), never registration or load.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
  CMD ["meshctl", "--server", "127.0.0.1:8081", "--timeout-ms", "3000", "health"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["meshd-agent"]
# OCI annotations (docker/README.md "Build arguments"). VERSION defaults to the
# repository's VERSION file (a test keeps them equal); REVISION is the git
# commit; SOURCE and LICENSES are for whoever publishes the image (the
# repository states no licence: SPDX NOASSERTION).
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE=unknown
ARG LICENSES=NOASSERTION
LABEL org.opencontainers.image.title="meshd-agent-cpu" \
      org.opencontainers.image.description="meshd agent for CPU devices (Debian 12, no CUDA)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="${LICENSES}" \
      org.opencontainers.image.base.name="docker.io/library/debian:bookworm-slim"
