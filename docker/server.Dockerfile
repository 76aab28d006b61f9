# syntax=docker/dockerfile:1
# meshd server image. Build from the repository root:
#   docker build -f docker/server.Dockerfile -t meshd-server .

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
 && cmake --build build -j"$(nproc)" --target meshd meshd-agent meshctl

# --- runtime ------------------------------------------------------------------
FROM debian:bookworm-slim
ARG DEBIAN_FRONTEND=noninteractive
# Runtime libraries only: exactly what the binaries link (readelf -d: NEEDED),
# by package. meshd-agent comes along for --local-agents (meshd runs the
# meshd-agent next to itself); no CUDA here.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      libgrpc29 libprotobuf-c1 libcurl4 libmicrohttpd12 libopenblas0-pthread libjson-c5 libssl3 \
      ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 meshd \
 && useradd --system --uid 10001 --gid meshd --no-create-home --home-dir /tmp \
      --shell /usr/sbin/nologin meshd
COPY --from=build /src/build/bin/meshd /src/build/bin/meshd-agent /src/build/bin/meshctl /usr/local/bin/
# Runs as uid/gid 10001 and writes nothing outside /tmp (--local-agents: the
# join token it hands its agents), a tmpfs or emptyDir where the root
# filesystem is read-only (compose read_only, k8s readOnlyRootFilesystem).
USER 10001:10001
WORKDIR /tmp
ENV MESHD_LISTEN=0.0.0.0:50051 \
    MESHD_HEALTH_LISTEN=0.0.0.0:8080 \
    HOME=/tmp \
    TMPDIR=/tmp
# 50051 clients; 50053 the agent registry when MESHD_CLUSTER_LISTEN puts it there
# (cluster mTLS: certificates and the join token are mounted, e.g. under
# /etc/meshd/cluster and /etc/meshd/join; docs/operations.md "Cluster security");
# 8080 grpc.health.v1 alone, in plaintext, for probes and the HEALTHCHECK
# whatever the client port needs (TLS, a token, another port); 9090 /metrics
# where MESHD_METRICS_LISTEN puts it.
EXPOSE 50051 50053 8080 9090
# Docker's health is liveness: "" (accepting calls), never agent count or load.
# Readiness (meshd.v1.TensorService) is the orchestrator's business. The empty
# TLS flags: MESHD_TLS_CERT/KEY, when set, are the server's own certificate,
# which meshctl would take for a client certificate.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
  CMD ["meshctl", "--server", "127.0.0.1:8080", "--tls-cert=", "--tls-key=", "--timeout-ms", "3000", "health"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["meshd"]
# OCI annotations (docker/README.md "Build arguments"). VERSION defaults to the
# repository's VERSION file (a test keeps them equal); REVISION is the git
# commit; SOURCE and LICENSES are for whoever publishes the image (the
# repository states no licence: SPDX NOASSERTION).
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE=unknown
ARG LICENSES=NOASSERTION
LABEL org.opencontainers.image.title="meshd-server" \
      org.opencontainers.image.description="meshd server: sessions, meshes and the agent registry (Debian 12, no CUDA)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="${LICENSES}" \
      org.opencontainers.image.base.name="docker.io/library/debian:bookworm-slim"
