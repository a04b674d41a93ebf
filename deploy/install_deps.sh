#!/usr/bin/env bash
# Installs the Debian packages modelavg builds and tests with. Needs root (or sudo).
# CUDA and NCCL are not Debian packages: the build finds them under /usr/local/cuda when present
# and builds everything else without them.
# The container engine (podman or Docker) is set up by deploy/container_setup.sh.
# Everything (no option) also makes the Python that the tests, examples and benchmarks run with: a
# virtual environment at .venv in the repository root for /usr/bin/python3, with the pinned PyPI
# packages of deploy/requirements-test.txt (PyTorch 2.x, torchft, pytest). Once complete it is
# left alone; a changed requirements file installs the difference.
#   bash deploy/install_deps.sh           # everything: build, tests, development (tests/run_all.sh)
#   bash deploy/install_deps.sh --build   # only what building the programs needs (the image)
#   bash deploy/install_deps.sh --demo    # what examples/run_demo.sh needs: the build packages
#                                         # but etcd's protos (it runs only the coordinator, with
#                                         # its state in memory, and the demo it builds)
#   ... --list                            # print the set's packages, install nothing
set -euo pipefail
# What building needs (with -DMODELAVG_BUILD_TESTS=OFF -DMODELAVG_BUILD_BENCH=OFF).
build_packages=(
  g++ cmake ninja-build pkg-config
  # Compiler cache: tests/run_all.sh and tests/sanitize.sh use it when present.
  ccache
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libgloo-dev prometheus-cpp-dev
  # gRPC's health and reflection protos, for modelavg-health and modelavg-rpc.
  grpc-proto
  # Coordinator --state_dir (SQLite).
  libsqlite3-dev
  # The coordinator's HTTP port (/metrics, the status page): an event-loop HTTP server.
  libmicrohttpd-dev
  # The Gloo pairs' proof of membership (HMAC-SHA256, client/comm/gloo/pair_proof.h).
  libssl-dev
)
# Coordinator --etcd_endpoints: etcd's v3 API protos, from which the build generates its stubs.
# Not for the demo, whose coordinator keeps its state in memory (examples/run_demo.sh configures
# -DMODELAVG_WITH_ETCD=OFF): the image and the tests build the etcd store.
etcd_packages=(golang-etcd-server-dev golang-github-gogo-protobuf-dev
               golang-github-grpc-ecosystem-grpc-gateway-dev)
packages=(
  "${build_packages[@]}" "${etcd_packages[@]}" build-essential git
  libgtest-dev libgmock-dev
  # The sqlite3 shell backs the coordinator's state up while it runs (README).
  sqlite3
  # Tests that need no PyTorch (run by /usr/bin/python3): a reflection-only client (like
  # grpcurl), the compose/k8s file checks, the CLI. The others run in .venv (below), which
  # python3-venv makes.
  python3 python3-grpcio python3-grpc-tools python3-yaml python3-venv
  # The Python package (pybind11 binding, built for /usr/bin/python3, which .venv's python is);
  # its wheel is built offline by that Python's pip, setuptools and wheel (deploy/build_wheel.sh).
  python3-dev pybind11-dev python3-pip python3-setuptools python3-wheel
  # Coordinator TLS tests make a throwaway certificate.
  openssl
  # The coordinator HA tests run an etcd cluster on loopback (etcdctl to inspect it).
  etcd-server etcd-client
  # tests/sanitize.sh: ASan+UBSan build and libFuzzer targets (the fuzzer runtime and
  # <fuzzer/FuzzedDataProvider.h> are in libclang-rt-14-dev).
  clang-14 libclang-rt-14-dev
  # Debian packages (cpack): dpkg-shlibdeps computes their dependencies, file finds the binaries.
  dpkg-dev file
  # The status page in a real browser (headless Chromium over the DevTools protocol), and
  # promtool for the alerting rules in deploy/prometheus/.
  chromium python3-websocket prometheus
  # The cluster tests and the LM benchmark (network namespaces, veth, bridges, tc/tbf); the
  # benchmark's corpus (fortunes) and its plot (matplotlib).
  iproute2 fortunes python3-matplotlib
  # Only tests/sanitize.sh's ThreadSanitizer run of the Python package: its interpreter
  # (tests/tools/tsan_python.cc) embeds /usr/bin/python3 and loads the TSan-built module beside
  # Debian's PyTorch 1.13, as it long has (PyPI's libtorch under TSan is untried); every other
  # Python test uses .venv's PyTorch.
  # Debian's PyTorch uses the system BLAS: OpenBLAS instead of the reference one (10x faster).
  python3-torch python3-pytest libopenblas0-pthread
)
list=0
venv=1
for arg in "$@"; do
  case "$arg" in
    --build) packages=("${build_packages[@]}" "${etcd_packages[@]}"); venv=0 ;;
    --demo) packages=("${build_packages[@]}"); venv=0 ;;
    --list) list=1 ;;
    *) echo "usage: $0 [--build | --demo] [--list]" >&2; exit 2 ;;
  esac
done
if [ "$list" = 1 ]; then
  printf '%s\n' "${packages[@]}"
  exit 0
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#packages[@]} packages present"
else
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "install_deps: installing ${missing[*]}"
  $sudo apt-get update
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends "${missing[@]}"
fi
[ "$venv" = 1 ] || exit 0

# .venv: complete when it holds a copy of the requirements file it was made from (written last).
repo=$(cd "$(dirname "$0")/.." && pwd)
requirements=$repo/deploy/requirements-test.txt
done_mark=$repo/.venv/modelavg-requirements.txt
if cmp -s "$requirements" "$done_mark"; then
  echo "install_deps: .venv complete ($(grep -c '==' "$requirements") pinned packages)"
  exit 0
fi
start=$(date +%s)
[ -x "$repo/.venv/bin/python" ] || /usr/bin/python3 -m venv "$repo/.venv"
# The list is closed and pinned, so --no-deps: nothing else comes in (not triton, see the file).
# No cache: the wheels (about 3 GB) are not kept a second time.
"$repo/.venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir \
  --no-deps -r "$requirements"
cp "$requirements" "$done_mark"
echo "install_deps: .venv made in $(( $(date +%s) - start )) s" \
  "($(du -sh "$repo/.venv" | cut -f1))"
