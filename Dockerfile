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
 && mkdir -p /out/bin \
 && for b in modelavg-coordinator modelavg-demo modelavg-trace-worker modelavg-health \
             modelavg-rpc modelavg; do \
      f=$(find /build -type f -name "$b" -perm -u+x | head -1); \
      [ -n "$f" ] || { echo "missing binary $b" >&2; exit 1; }; \
      install -m 0755 -s "$f" /out/bin/; \
    done \
 && bash deploy/runtime_packages.sh /out/bin/* > /out/runtime-packages.txt \
 && echo etcd-server >> /out/runtime-packages.txt \
 && cat /out/runtime-packages.txt

# ---- runtime: the programs and exactly the shared libraries they load ----
FROM debian:${DEBIAN_RELEASE}-slim AS runtime
ENV DEBIAN_FRONTEND=noninteractive
COPY --from=build /out/runtime-packages.txt /tmp/runtime-packages.txt
RUN apt-get update \
 && xargs -a /tmp/runtime-packages.txt apt-get install -y --no-install-recommends \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log \
           /tmp/runtime-packages.txt \
 && groupadd --system --gid 10001 modelavg \
 && useradd --system --uid 10001 --gid modelavg --home-dir /var/lib/modelavg --create-home \
        --shell /usr/sbin/nologin modelavg
COPY --from=build /out/bin/ /usr/local/bin/
COPY deploy/jobs/ /etc/modelavg/
USER 10001:10001
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
