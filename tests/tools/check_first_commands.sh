#!/usr/bin/env bash
# The README's first two commands install what each runs: `bash examples/run_demo.sh` only the
# build's packages (deploy/install_deps.sh --demo) and a build without the tests, whose packages
# (PyTorch, Chromium, clang, Prometheus, etcd, GoogleTest, pytest) it never uses;
# `bash tests/run_all.sh` all of them, with the tests on. Prints what is wrong and exits 1.
set -euo pipefail
cd "$(dirname "$0")/../.."
fail=0
problem() { echo "FAIL: $*" >&2; fail=1; }
demo=$(bash deploy/install_deps.sh --demo --list)
all=$(bash deploy/install_deps.sh --list)
for heavy in python3-torch chromium clang-14 prometheus etcd-server python3-pytest libgtest-dev; do
  grep -qx "$heavy" <<<"$demo" && problem "the demo's packages include $heavy"
  grep -qx "$heavy" <<<"$all" || problem "the tests' packages lack $heavy"
done
while read -r p; do
  grep -qx "$p" <<<"$all" || problem "$p is in the demo's set but not in the full one"
done <<<"$demo"
grep -q 'bash deploy/install_deps.sh --demo$' examples/run_demo.sh ||
  problem "examples/run_demo.sh does not install with --demo"
grep -q 'DMODELAVG_BUILD_TESTS=OFF' examples/run_demo.sh ||
  problem "examples/run_demo.sh configures a build with the tests"
grep -q '^bash deploy/install_deps.sh$' tests/run_all.sh ||
  problem "tests/run_all.sh does not install every package"
grep -q 'DMODELAVG_BUILD_TESTS=ON' tests/run_all.sh ||
  problem "tests/run_all.sh does not turn the tests on (a build the demo configured has them off)"
[ "$fail" = 0 ] && echo "first commands: the demo installs $(wc -l <<<"$demo") packages, the tests $(wc -l <<<"$all")"
exit "$fail"
