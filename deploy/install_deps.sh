#!/usr/bin/env bash
# Installs the Debian packages modelavg builds and tests with. Needs root (or sudo).
# CUDA and NCCL are not Debian packages: the build finds them under /usr/local/cuda when present
# and builds everything else without them.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libgtest-dev libgmock-dev libgloo-dev prometheus-cpp-dev
  # Coordinator --state_dir (SQLite); the sqlite3 shell backs it up while it runs (README).
  libsqlite3-dev sqlite3
  # Tests: reflection-only client (like grpcurl), PyTorch conformance, compose/k8s file checks.
  python3 python3-grpcio python3-grpc-tools grpc-proto python3-torch python3-yaml
  # The Python package (pybind11 binding, built for the system's python3).
  python3-dev pybind11-dev
  # Coordinator TLS tests make a throwaway certificate.
  openssl
  # Debian packages (cpack): dpkg-shlibdeps computes their dependencies, file finds the binaries.
  dpkg-dev file
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#packages[@]} packages present"
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "install_deps: installing ${missing[*]}"
$sudo apt-get update
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends "${missing[@]}"
