# modelavg container image: the coordinator daemon, the demo trainer, the trace worker, the gRPC
# health probe and a reflection client, on a slim Debian runtime, running as a non-root user.
#
#   docker build -t modelavg:latest .
#   podman build --format docker -t modelavg:latest .    # docker format keeps the HEALTHCHECK
#   docker run --rm -p 127.0.0.1:50051:50051 -p 127.0.0.1:9464:9464 modelavg:latest
#
# The image builds the CPU (Gloo) path only, without tests or benchmarks. The NCCL path needs the
# CUDA toolkit and NCCL in the build stage (e.g. an nvidia/cuda devel base) and
# -DMODELAVG_WITH_CUDA=ON.
#
# Two final stages share everything but where the programs come from: `runtime` (the default, the
# last stage) compiles them in the `build` stage; `prebuilt` takes programs already built on a
# Debian host of the same release from prebuilt/bin/ of the build context, with the packages their
# libraries need in prebuilt/runtime-packages.txt (deploy/runtime_packages.sh). The container test
# uses `prebuilt` with the binaries of the build it tests, so that CI compiles nothing twice:
#   podman build --format docker --target prebuilt -t modelavg:latest CONTEXT

ARG DEBIAN_RELEASE=bookworm

# ---- build: only the Debian packages building needs, then only the shipped programs ----
FROM debian:${DEBIAN_RELEASE} AS build
ENV DEBIAN_FRONTEND=noninteractive
COPY deploy/install_deps.sh /src/deploy/install_deps.sh
RUN bash /src/deploy/install_deps.sh --build && rm -rf /var/lib/apt/lists/*
COPY . /src
WORKDIR /src
ARG MODELAVG_JOBS=2
RUN cmake -S . -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMODELAVG_WITH_CUDA=OFF \
        -DMODELAVG_BUILD_TESTS=OFF -DMODELAVG_BUILD_BENCH=OFF -DMODELAVG_WITH_PYTHON=OFF \
        -DMODELAVG_BUILD_TOOLS=ON \
 && cmake --build /build -j "${MODELAVG_JOBS}" --target \
        modelavg-coordinator modelavg-demo modelavg-trace-worker modelavg-health modelavg-rpc \
        modelavg-cli \
 && bash deploy/collect_programs.sh /build /out

# ---- the runtime image's settings, shared by both final stages (no programs yet) ----
FROM debian:${DEBIAN_RELEASE}-slim AS runtime-base
ENV DEBIAN_FRONTEND=noninteractive
COPY deploy/install_runtime.sh /usr/local/lib/modelavg/install_runtime.sh
RUN groupadd --system --gid 10001 modelavg \
 && useradd --system --uid 10001 --gid modelavg --home-dir /var/lib/modelavg --create-home \
        --shell /usr/sbin/nologin modelavg
COPY deploy/jobs/ /etc/modelavg/
# The coordinator's state directory, owned by the modelavg user: mount a volume here (the compose
# file and the Kubernetes manifests do; `docker run -v modelavg-state:/var/lib/modelavg ...
# --state_dir=/var/lib/modelavg/state`) so that what the coordinator keeps outlives the container.
# Not a VOLUME instruction: that would give every container of the image (workers and one-off
# inspect runs too) an anonymous volume, which podman-compose's `down -v` leaves behind.
WORKDIR /var/lib/modelavg
# 50051: gRPC (Coordinator, health, reflection). 9464: Prometheus metrics.
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["modelavg-health", "--coordinator=127.0.0.1:50051", "--rpc_timeout_ms=2000"]
CMD ["modelavg-coordinator", "--listen=0.0.0.0:50051", "--metrics_listen=0.0.0.0:9464", \
     "--jobs_file=/etc/modelavg/demo-jobs.json", "--log_level=info"]

# ---- prebuilt: the programs of a build made outside the image (the container test) ----
FROM runtime-base AS prebuilt
COPY prebuilt/ /tmp/prebuilt/
RUN sh /usr/local/lib/modelavg/install_runtime.sh /tmp/prebuilt
USER 10001:10001

# ---- runtime (the default): the programs the build stage compiled ----
FROM runtime-base AS runtime
COPY --from=build /out/ /tmp/prebuilt/
RUN sh /usr/local/lib/modelavg/install_runtime.sh /tmp/prebuilt
USER 10001:10001
