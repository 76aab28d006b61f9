# syntax=docker/dockerfile:1
# meshd-agent image. Build from the repository root:
#   docker build -f docker/agent.Dockerfile -t meshd-agent .
#
# The CUDA backend (--device cuda:N) arrives with the GPU issue; until then this
# builds the cpu agent, already on the CUDA runtime base (with NCCL) that the
# GPU agent will run on.

# --- build: the same packages as .ci/install-deps (Debian 12) ---------------
FROM debian:bookworm AS build
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      build-essential cmake pkg-config \
      libgrpc-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler \
      libcriterion-dev libcurl4-openssl-dev libmicrohttpd-dev uthash-dev libopenblas-dev \
      ca-certificates \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN rm -rf build \
 && cmake -S . -B build -DMESHD_BUILD_TESTS=OFF \
 && cmake --build build -j"$(nproc)" --target meshd-agent meshctl

# --- runtime: NVIDIA CUDA runtime (ships libnccl2) --------------------------
# Ubuntu 24.04 rather than 22.04: the binaries are built against Debian 12's
# gRPC 1.51 (libgrpc.so.29), which Ubuntu 24.04 ships as libgrpc29t64 (same
# soname and ABI on amd64); Ubuntu 22.04 only has gRPC 1.30 (libgrpc.so.10).
FROM nvidia/cuda:12.6.3-runtime-ubuntu24.04
ARG DEBIAN_FRONTEND=noninteractive
# libnccl2 is already in the runtime image; installing it again from the CUDA
# apt repository the image configures is a no-op that documents the need.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      libgrpc29t64 libprotobuf-c1 libmicrohttpd12t64 libopenblas0-pthread libnccl2 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 meshd \
 && useradd --system --uid 10001 --gid meshd --no-create-home --shell /usr/sbin/nologin meshd
COPY --from=build /src/build/bin/meshd-agent /src/build/bin/meshctl /usr/local/bin/
USER 10001:10001
ENV MESHD_LISTEN=0.0.0.0:50052 \
    NCCL_DEBUG=WARN
EXPOSE 50052
# Liveness only: "" (accepting calls), never registration or load.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
  CMD ["meshctl", "--server", "127.0.0.1:50052", "--timeout-ms", "3000", "health"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["meshd-agent"]
