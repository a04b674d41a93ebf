#!/usr/bin/env bash
# Prints, one per line, the Debian packages that own the shared libraries the given binaries load.
# The container build uses it so that the runtime image installs exactly what the binaries need.
#   bash deploy/runtime_packages.sh build/server/modelavg-coordinator build/examples/modelavg-demo
set -euo pipefail
if [ $# -eq 0 ]; then
  echo "usage: $0 BINARY..." >&2
  exit 2
fi
libs=()
for bin in "$@"; do
  [ -x "$bin" ] || { echo "runtime_packages: $bin is not an executable file" >&2; exit 1; }
  while read -r lib; do
    libs+=("$lib")
  done < <(ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}')
done
mapfile -t libs < <(printf '%s\n' "${libs[@]}" | sort -u)
# dpkg knows a file by the path its package shipped; with merged /usr that may be any of these.
candidates() {
  local real
  real=$(readlink -f "$1")
  printf '%s\n' "$1" "$real" "${1#/usr}" "${real#/usr}" | sort -u
}
declare -A owner=()
mapfile -t all < <(for lib in "${libs[@]}"; do candidates "$lib"; done | sort -u)
# One dpkg-query for every path (it is slow per call); unknown paths just print nothing.
while IFS= read -r line; do
  pkg=${line%%: *}
  path=${line#*: }
  owner[$path]=${pkg%%:*}
done < <(dpkg-query -S "${all[@]}" 2>/dev/null || true)
for lib in "${libs[@]}"; do
  pkg=""
  while read -r c; do
    [ -n "${owner[$c]:-}" ] && { pkg=${owner[$c]}; break; }
  done < <(candidates "$lib")
  if [ -z "$pkg" ]; then
    # Not from a Debian package (e.g. CUDA/NCCL under /usr/local): the image must provide it.
    echo "runtime_packages: no Debian package owns $lib" >&2
    continue
  fi
  echo "$pkg"
done | sort -u
