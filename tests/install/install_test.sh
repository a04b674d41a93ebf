#!/usr/bin/env bash
# The installed library, as a user outside this tree sees it. From an already built build directory:
#   1. `cmake --install` into a temporary prefix;
#   2. `cpack` builds the Debian packages, `dpkg -x` unpacks them into a temporary root (nothing is
#      installed on the system), and their control fields are checked;
#   3. from each of the two: the documented C++ example (CMakeLists.txt and trainer.cc, extracted from
#      docs/cpp.md, so the two cannot drift) is built as its own project with
#      find_package(modelavg CONFIG REQUIRED) and CMAKE_PREFIX_PATH; a file that includes every
#      installed header is built through pkg-config; and the example runs as a two-rank job against
#      the installed modelavg-coordinator, whose result must be the averaged one.
#   bash tests/install/install_test.sh [BUILD_DIR]      (default: $MODELAVG_BUILD_DIR or build)
# tests/run_all.sh runs it after ctest. Temporary files and started processes are removed on exit.
set -euo pipefail
src_dir=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-${MODELAVG_BUILD_DIR:-$src_dir/build}}
[ -f "$build/CMakeCache.txt" ] || { echo "install_test: $build is not a build directory" >&2; exit 2; }
build=$(cd "$build" && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/modelavg-install-test.XXXXXX")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "install_test: FAIL: $*" >&2; exit 1; }
say() { echo "install_test: $*"; }
# run LOG CMD...: runs CMD with its output in LOG; on failure prints the log and fails.
run() {
  local log=$1; shift
  local status=0
  "$@" > "$log" 2>&1 || status=$?
  [ "$status" -eq 0 ] || { cat "$log" >&2; fail "$* (exit $status)"; }
}
start=$(date +%s)

# The fenced block that follows the line "<!-- example: NAME ..." in docs/cpp.md.
extract() {
  awk -v marker="<!-- example: $1" '
    index($0, marker) == 1 { want = 1; next }
    want && /^```/ { if (inside) exit; inside = 1; next }
    inside { print }' "$src_dir/docs/cpp.md"
}

# libdir_of PREFIX: the library directory of the installation under PREFIX.
libdir_of() {
  local config
  config=$(find "$1" -path '*/cmake/modelavg/modelavgConfig.cmake' -print -quit)
  [ -n "$config" ] || fail "no cmake/modelavg/modelavgConfig.cmake under $1"
  realpath "${config%/cmake/modelavg/modelavgConfig.cmake}"
}

# check_prefix NAME PREFIX: builds the example and the header check against PREFIX, runs the job.
check_prefix() {
  local name=$1 prefix=$2 dir=$tmp/$1 libdir
  libdir=$(libdir_of "$prefix")
  mkdir -p "$dir/example"
  extract CMakeLists.txt > "$dir/example/CMakeLists.txt"
  extract trainer.cc > "$dir/example/trainer.cc"
  grep -q 'find_package(modelavg CONFIG REQUIRED)' "$dir/example/CMakeLists.txt" ||
    fail "docs/cpp.md has no '<!-- example: CMakeLists.txt' block with find_package(modelavg ...)"
  grep -q '#include <modelavg/client/averager.h>' "$dir/example/trainer.cc" ||
    fail "docs/cpp.md has no '<!-- example: trainer.cc' block including <modelavg/client/averager.h>"

  say "$name: building the documented example (docs/cpp.md) with find_package(modelavg) from $prefix"
  run "$dir/configure.log" cmake -S "$dir/example" -B "$dir/example/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix"
  local found
  found=$(sed -n 's/^modelavg_DIR:PATH=//p' "$dir/example/build/CMakeCache.txt")
  [ "$(realpath "$found")" = "$libdir/cmake/modelavg" ] ||
    fail "$name: find_package found modelavg in '$found', not under $prefix"
  run "$dir/build.log" cmake --build "$dir/example/build"
  local trainer=$dir/example/build/trainer
  # (Output captured first: with pipefail, grep -q closing a pipe early would fail the writer.)
  local loads
  loads=$(ldd "$trainer")
  grep -q "libmodelavg_client\.so.* => $libdir/" <<< "$loads" ||
    { echo "$loads" >&2; fail "$name: the example does not load the library from $prefix"; }

  say "$name: every installed header, through pkg-config"
  local headers
  headers=$(cd "$prefix/include" && find modelavg -name '*.h' | sort)
  [ -n "$headers" ] || fail "$name: no headers under $prefix/include/modelavg"
  {
    for h in $headers; do echo "#include <$h>"; done
    echo 'int main() { return modelavg::client::DTypeName(modelavg::client::DType::kBFloat16) == "bfloat16" ? 0 : 1; }'
  } > "$dir/headers.cc"
  local flags
  flags=$(PKG_CONFIG_PATH="$libdir/pkgconfig" pkg-config --cflags --libs modelavg) ||
    fail "$name: pkg-config --cflags --libs modelavg failed"
  # shellcheck disable=SC2086  # the flags are words
  run "$dir/headers.log" c++ -std=c++17 "$dir/headers.cc" -o "$dir/headers" $flags
  LD_LIBRARY_PATH="$libdir" "$dir/headers" || fail "$name: the header check program failed"
  if [ "$name" = prefix ]; then  # each header on its own, once (the packages hold the same files)
    local h
    for h in $headers; do
      # shellcheck disable=SC2086
      echo "#include <$h>" | c++ -std=c++17 -fsyntax-only -x c++ - $flags 2> "$dir/header.log" ||
        { cat "$dir/header.log" >&2; fail "$name: <$h> does not compile on its own"; }
    done
  fi

  say "$name: the example as a two-rank job against $prefix/bin/modelavg-coordinator"
  cat > "$dir/jobs.json" <<'EOF'
{"jobs": [{"job_id": "example", "world_size": 2, "mode": "PERIODIC",
           "levels": [{"period": 4, "group_size": 2}]}]}
EOF
  "$prefix/bin/modelavg-coordinator" --listen=127.0.0.1:0 --port_file="$dir/port" \
    --jobs_file="$dir/jobs.json" > "$dir/coordinator.log" 2>&1 &
  local coordinator=$!
  pids+=("$coordinator")
  local address=""
  for _ in $(seq 300); do
    address=$(cat "$dir/port" 2>/dev/null || true)
    [[ $address =~ :[0-9]+$ ]] && break
    kill -0 "$coordinator" 2>/dev/null || { cat "$dir/coordinator.log" >&2; fail "$name: the coordinator exited"; }
    sleep 0.1
  done
  [[ $address =~ :[0-9]+$ ]] || { cat "$dir/coordinator.log" >&2; fail "$name: no port file after 30 s"; }
  local r rank_pids=()
  for r in 0 1; do
    timeout 120 "$trainer" "$address" example "$r" > "$dir/rank$r.log" 2>&1 &
    rank_pids+=($!)
    pids+=($!)
  done
  local status
  for r in 0 1; do
    status=0
    wait "${rank_pids[$r]}" || status=$?
    [ "$status" -eq 0 ] ||
      { cat "$dir/rank$r.log" "$dir/coordinator.log" >&2; fail "$name: rank $r exited $status"; }
  done
  kill -TERM "$coordinator"
  wait "$coordinator" || { cat "$dir/coordinator.log" >&2; fail "$name: the coordinator did not stop cleanly"; }
  # Ranks start at 0 and 1, add 0.01 per step for 100 steps, and average every 4 steps: both end
  # at 1.5 after 25 averagings (without averaging: 1 and 2).
  for r in 0 1; do
    grep -qx "rank $r: weights\[0\] = 1.5 after 25 averagings" "$dir/rank$r.log" ||
      { cat "$dir/rank$r.log" >&2; fail "$name: rank $r did not end averaged"; }
  done
  # The Python package, when it was built: importable from PREFIX, and imported from there.
  local pydir=$prefix/lib/python3/dist-packages
  if [ -d "$pydir/modelavg" ]; then
    local where
    where=$(cd "$dir" && PYTHONPATH="$pydir" python3 -c 'import modelavg; print(modelavg.__file__)') ||
      fail "$name: import modelavg from $pydir failed"
    [[ $where == "$pydir/modelavg/"* ]] || fail "$name: modelavg was imported from $where, not $pydir"
    say "$name: import modelavg ok"
  fi
  say "$name: ok ($(grep -h "weights" "$dir/rank0.log" "$dir/rank1.log" | tr "\n" " "))"
}

say "installing $build into a temporary prefix"
run "$tmp/install.log" cmake --install "$build" --prefix "$tmp/prefix"
check_prefix prefix "$tmp/prefix"

say "building the Debian packages"
run "$tmp/cpack.log" cpack --config "$build/CPackConfig.cmake" -B "$tmp/debs"
# deb_of PACKAGE: the .deb built for PACKAGE.
deb_of() {
  local f
  for f in "$tmp"/debs/*.deb; do
    [ "$(dpkg-deb -f "$f" Package)" = "$1" ] && { echo "$f"; return; }
  done
  ls "$tmp/debs" >&2
  fail "no Debian package $1 was built"
}
soversion=$(sed -n 's/^set(modelavg_SOVERSION \(.*\))$/\1/p' "$(libdir_of "$tmp/prefix")/cmake/modelavg/modelavgConfig.cmake")
[ -n "$soversion" ] || fail "modelavgConfig.cmake does not set modelavg_SOVERSION"
lib_deb=$(deb_of "libmodelavg-client$soversion")
dev_deb=$(deb_of libmodelavg-client-dev)
tools_deb=$(deb_of modelavg)
# dpkg-shlibdeps named the Debian runtime packages of the libraries loaded.
lib_depends=$(dpkg-deb -f "$lib_deb" Depends)
for dep in libgrpc++ libprotobuf libgloo libabsl libstdc++6; do
  grep -qF "$dep" <<< "$lib_depends" || fail "$(basename "$lib_deb") does not depend on $dep: $lib_depends"
done
tools_depends=$(dpkg-deb -f "$tools_deb" Depends)
for dep in libgrpc++ libprometheus-cpp; do
  grep -qF "$dep" <<< "$tools_depends" ||
    fail "$(basename "$tools_deb") does not depend on $dep: $tools_depends"
done
grep -qF "libmodelavg-client$soversion (= " <<< "$(dpkg-deb -f "$dev_deb" Depends)" ||
  fail "$(basename "$dev_deb") does not depend on its exact library version"
# Packages built against the library will depend on it through its shlibs file.
shlibs=$(dpkg-deb --ctrl-tarfile "$lib_deb" | tar -xO ./shlibs) || fail "$(basename "$lib_deb") has no shlibs file"
grep -qF "libmodelavg_client $soversion libmodelavg-client$soversion " <<< "$shlibs" ||
  fail "$(basename "$lib_deb") has no shlibs entry for libmodelavg_client $soversion"
for f in "$tmp"/debs/*.deb; do
  dpkg -x "$f" "$tmp/root"
done
soname=$(readelf -d "$(libdir_of "$tmp/root/usr")/libmodelavg_client.so.$soversion" | sed -n 's/.*SONAME.*\[\(.*\)\]/\1/p')
[ "$soname" = "libmodelavg_client.so.$soversion" ] || fail "SONAME is '$soname'"
check_prefix deb "$tmp/root/usr"
say "ok in $(( $(date +%s) - start )) s"
