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
      libcriterion-dev libcurl4-openssl-dev libmicrohttpd-dev uthash-dev libopenblas-dev \
      libssl-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN rm -rf build \
 && cmake -S . -B build -DMESHD_BUILD_TESTS=OFF \
 && cmake --build build -j"$(nproc)" --target meshd meshd-agent meshctl

# --- runtime ------------------------------------------------------------------
FROM debian:bookworm-slim
ARG DEBIAN_FRONTEND=noninteractive
# Runtime libraries only. meshd-agent comes along for --local-agents (meshd runs
# the meshd-agent next to itself).
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      libgrpc29 libprotobuf-c1 libmicrohttpd12 libopenblas0-pthread libssl3 libjson-c5 \
      ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 meshd \
 && useradd --system --uid 10001 --gid meshd --no-create-home --shell /usr/sbin/nologin meshd
COPY --from=build /src/build/bin/meshd /src/build/bin/meshd-agent /src/build/bin/meshctl /usr/local/bin/
USER 10001:10001
ENV MESHD_LISTEN=0.0.0.0:50051
# 50051 clients; 50053 the agent registry when MESHD_CLUSTER_LISTEN puts it there
# (cluster mTLS: certificates and the join token are mounted, e.g. under
# /etc/meshd/cluster and /etc/meshd/join; docs/operations.md "Cluster security").
EXPOSE 50051 50053
# Docker's health is liveness: "" (accepting calls), never agent count or load.
# Readiness (meshd.v1.TensorService) is the orchestrator's business.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
  CMD ["meshctl", "--server", "127.0.0.1:50051", "--timeout-ms", "3000", "health"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["meshd"]
