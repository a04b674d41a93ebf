#!/bin/sh
# Inside the image (Dockerfile, both final stages): installs the Debian packages listed in
# DIR/runtime-packages.txt, the programs of DIR/bin/ into /usr/local/bin and the libraries of
# DIR/lib/ (none from the image's own build stage) into /usr/local/lib, then removes DIR and
# apt's lists and logs, so that the image holds exactly the programs and the libraries they load.
#   sh install_runtime.sh DIR
set -eu
dir=$1
[ -s "$dir/runtime-packages.txt" ] || { echo "install_runtime: $dir/runtime-packages.txt is missing or empty" >&2; exit 1; }
[ -x "$dir/bin/modelavg-coordinator" ] || { echo "install_runtime: no $dir/bin/modelavg-coordinator" >&2; exit 1; }
apt-get update
xargs -a "$dir/runtime-packages.txt" apt-get install -y --no-install-recommends
install -m 0755 "$dir"/bin/* /usr/local/bin/
if [ -d "$dir/lib" ]; then
  install -m 0644 "$dir"/lib/* /usr/local/lib/
  ldconfig
fi
rm -rf "$dir" /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log
