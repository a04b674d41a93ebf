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
for lib in $(printf '%s\n' "${libs[@]}" | sort -u); do
  pkg=""
  # dpkg knows a file by the path its package shipped; with merged /usr that may be either form.
  for candidate in "$lib" "$(readlink -f "$lib")" "${lib#/usr}" "$(readlink -f "$lib" | sed 's|^/usr||')"; do
    pkg=$(dpkg-query -S "$candidate" 2>/dev/null | head -1 | cut -d: -f1) && [ -n "$pkg" ] && break
  done
  if [ -z "$pkg" ]; then
    # Not from a Debian package (e.g. CUDA/NCCL under /usr/local): the image must provide it.
    echo "runtime_packages: no Debian package owns $lib" >&2
    continue
  fi
  echo "$pkg"
done | sort -u
