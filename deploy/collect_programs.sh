#!/usr/bin/env bash
# Gathers the image's programs from a build directory into OUT/bin (stripped) and the Debian
# packages they load (plus etcd-server, which the compose file's etcd service runs) into
# OUT/runtime-packages.txt, and any library they load that no Debian package provides into OUT/lib:
# what the Dockerfile's final stages install (deploy/install_runtime.sh).
# The Dockerfile's build stage runs it on the build it made; the container test on the build it
# tests, for the `prebuilt` stage. The build must be of the image's Debian release.
#   bash deploy/collect_programs.sh BUILD_DIR OUT_DIR
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 BUILD_DIR OUT_DIR" >&2
  exit 2
fi
build=$1 out=$2
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out/bin"
for b in modelavg-coordinator modelavg-demo modelavg-trace-worker modelavg-health modelavg-rpc \
         modelavg; do
  f=$(find "$build" -type f -name "$b" -perm -u+x | head -1)
  [ -n "$f" ] || { echo "collect_programs: no $b in $build (build it first)" >&2; exit 1; }
  install -m 0755 -s "$f" "$out/bin/"
done
bash "$here/runtime_packages.sh" "$out"/bin/* >"$out/runtime-packages.txt" 2>"$out/unowned"
echo etcd-server >>"$out/runtime-packages.txt"
# A library no Debian package provides (CUDA's and NCCL's under /usr/local, in a build with the
# NCCL path) goes into OUT/lib under its soname; the image's programs could not start without it.
while read -r lib; do
  mkdir -p "$out/lib"
  cp -L "$lib" "$out/lib/$(basename "$lib")"
  echo "collect_programs: $lib is no Debian package's: copied into $out/lib" >&2
done < <(sed -n 's/^runtime_packages: no Debian package owns //p' "$out/unowned")
rm -f "$out/unowned"
cat "$out/runtime-packages.txt"
