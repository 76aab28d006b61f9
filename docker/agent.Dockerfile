# syntax=docker/dockerfile:1
# meshd-agent image with the cuda backend (--device cuda:N; --device cpu works
# too, but docker/agent-cpu.Dockerfile is far smaller for that). Build from the
# repository root:
#   docker build -f docker/agent.Dockerfile -t meshd-agent .
#
# Both stages are NVIDIA's CUDA 13 images on Ubuntu 24.04, which ships the
# gRPC 1.51 C core meshd is written against (libgrpc-dev / libgrpc29t64; Ubuntu
# 22.04 only has gRPC 1.30). The devel image brings nvcc, cuBLAS and NCCL; the
# runtime image their shared libraries.

# --- build ------------------------------------------------------------------
FROM nvidia/cuda:13.0.1-devel-ubuntu24.04 AS build
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      build-essential cmake pkg-config \
      libgrpc-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler \
      libcurl4-openssl-dev libmicrohttpd-dev uthash-dev libopenblas-dev libjson-c-dev \
      libnccl-dev libssl-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# sm_90 (Hopper) plus PTX for later GPUs; pass --build-arg CUDA_ARCHS=80;90 for Ampere too.
ARG CUDA_ARCHS=90
RUN rm -rf build \
 && cmake -S . -B build -DMESHD_BUILD_TESTS=OFF -DMESHD_WITH_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS}" \
 && cmake --build build -j"$(nproc)" --target meshd-agent meshctl

# --- runtime: the CUDA runtime image (cudart, cuBLAS, NCCL) -------------------
FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04
ARG DEBIAN_FRONTEND=noninteractive
# libnccl2 is already in the runtime image; installing it again from the CUDA
# apt repository the image configures is a no-op that documents the need.
# cuBLAS is not linked: the agent opens the image's libcublas.so.13 at its
# first matmul on a GPU (cpu agents never load it).
# The rest: exactly what the binaries link (readelf -d: NEEDED), by package.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      libgrpc29t64 libprotobuf-c1 libcurl4t64 libmicrohttpd12t64 libopenblas0-pthread libjson-c5 \
      libnccl2 libssl3t64 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 meshd \
 && useradd --system --uid 10001 --gid meshd --no-create-home --home-dir /tmp \
      --shell /usr/sbin/nologin meshd
COPY --from=build /src/build/bin/meshd-agent /src/build/bin/meshctl /usr/local/bin/
# Non-root (uid/gid 10001; the NVIDIA container toolkit grants the device nodes
# to any user) and fit for a read-only root filesystem: the CUDA JIT cache
# (PTX for GPUs newer than CUDA_ARCHS) goes to /tmp, and NCCL's shared memory
# to /dev/shm; both are tmpfs/emptyDir mounts in compose and k8s.
USER 10001:10001
WORKDIR /tmp
# 50052: the Agent service (for its server only: the call secret; mTLS with
# MESHD_CLUSTER_CA/CERT/KEY). 8081: grpc.health.v1 alone, in plaintext, for
# probes and the HEALTHCHECK whatever the gRPC port needs.
ENV MESHD_LISTEN=0.0.0.0:50052 \
    MESHD_HEALTH_LISTEN=0.0.0.0:8081 \
    NCCL_DEBUG=WARN \
    HOME=/tmp \
    TMPDIR=/tmp \
    CUDA_CACHE_PATH=/tmp/cuda-cache
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
LABEL org.opencontainers.image.title="meshd-agent" \
      org.opencontainers.image.description="meshd agent with the CUDA backend (cuBLAS, NCCL; Ubuntu 24.04, CUDA 13)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="${LICENSES}" \
      org.opencontainers.image.base.name="docker.io/nvidia/cuda:13.0.1-runtime-ubuntu24.04"
