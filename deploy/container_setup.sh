#!/usr/bin/env bash
# Makes a Debian 12 machine able to build and run modelavg's containers, and says what it did.
#
#   bash deploy/container_setup.sh           # set up (root or sudo): engine, compose, base image
#   bash deploy/container_setup.sh --check   # change nothing; exit 0 and print the engine and
#                                            # compose command when usable, else exit 1 saying why
#
# 1. The engine: a Docker whose daemon answers (`docker info`), else podman. Podman (with runc,
#    podman-compose, the dnsname CNI plugin so that service names resolve on a compose network,
#    and catatonit) is installed from Debian when missing, and configured by
#    /etc/containers/containers.conf.d/50-modelavg.conf: cgroupfs, file event logger, runc, and
#    default ulimits at this machine's hard limits (nofile at the hard limit, nproc at most 32768),
#    because containers fail to start ("error setting rlimits") where a limit may not be raised.
#    MODELAVG_CONTAINER_ENGINE=docker|podman picks one engine.
# 2. Compose: `docker compose`, else `docker-compose` (Debian's when Docker has neither) for
#    Docker; podman-compose for podman.
# 3. The base image: debian:bookworm and debian:bookworm-slim, pulled; when no registry can be
#    reached, made with `debootstrap --variant=minbase bookworm` from this machine's Debian mirror
#    and imported under both names.
# 4. A probe: a container runs.
# Running it again changes nothing that is already in place.
set -euo pipefail

mode=setup
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

say() { echo "container_setup: $*"; }
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
CONF=/etc/containers/containers.conf.d/50-modelavg.conf
BASE_TAGS=(debian:bookworm debian:bookworm-slim)
PODMAN_PACKAGES=(podman runc podman-compose golang-github-containernetworking-plugin-dnsname
                 catatonit)

# ---- engine and compose detection (no changes) ----
docker_usable() { command -v docker >/dev/null && timeout 20 docker info >/dev/null 2>&1; }
podman_usable() { command -v podman >/dev/null && timeout 20 podman info >/dev/null 2>&1; }

# Prints the compose command for $1, or nothing.
compose_for() {
  if [ "$1" = docker ]; then
    if timeout 20 docker compose version >/dev/null 2>&1; then echo "docker compose"
    elif command -v docker-compose >/dev/null; then echo "docker-compose"
    fi
  elif command -v podman-compose >/dev/null; then
    echo "podman-compose"
  fi
}

has_image() { timeout 30 "$1" image inspect "$2" >/dev/null 2>&1; }

# Sets engine/compose/why from what is there now.
detect() {
  engine="" compose="" why=""
  local want=${MODELAVG_CONTAINER_ENGINE:-}
  case "$want" in
    ""|docker|podman) ;;
    *) why="MODELAVG_CONTAINER_ENGINE=$want: expected docker or podman"; return ;;
  esac
  if [ "$want" != podman ] && docker_usable; then
    engine=docker
  elif [ "$want" != docker ] && podman_usable; then
    engine=podman
  else
    if [ "$want" = docker ]; then
      why="docker: no daemon answers 'docker info'"
    elif [ "$want" = podman ]; then
      why="podman is not installed or 'podman info' fails"
    elif command -v docker >/dev/null; then
      why="docker is installed but no daemon answers 'docker info', and podman is not usable"
    else
      why="neither a Docker daemon nor podman is usable"
    fi
    return
  fi
  compose=$(compose_for "$engine")
  [ -n "$compose" ] || why="$engine has no compose command"
}

if [ "$mode" = check ]; then
  detect
  if [ -z "$why" ]; then
    for tag in "${BASE_TAGS[@]}"; do
      has_image "$engine" "$tag" || { why="$engine has no $tag image"; break; }
    done
  fi
  if [ -n "$why" ]; then
    echo "not usable: $why (run: bash deploy/container_setup.sh)"
    exit 1
  fi
  echo "engine=$engine"
  echo "compose=$compose"
  exit 0
fi

# ---- setup ----
apt_install() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  say "installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
}

# The hard limits of this machine, which a container may keep but not exceed.
write_podman_conf() {
  local nofile nproc
  nofile=$(ulimit -Hn)
  nproc=$(ulimit -Hu)
  [ "$nofile" = unlimited ] && nofile=1048576
  if [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ]; then nproc=32768; fi
  local text
  text=$(cat <<EOF
# Written by modelavg's deploy/container_setup.sh. Containers start with this machine's hard
# limits (they may not raise one), cgroupfs and file events (no systemd needed), and runc.
[containers]
default_ulimits = ["nofile=${nofile}:${nofile}", "nproc=${nproc}:${nproc}"]

[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
runtime = "runc"
EOF
)
  if [ -f "$CONF" ] && [ "$(cat "$CONF")" = "$text" ]; then
    say "podman configuration $CONF already in place"
    return
  fi
  $sudo mkdir -p "$(dirname "$CONF")"
  printf '%s\n' "$text" | $sudo tee "$CONF" >/dev/null
  say "wrote $CONF (nofile=$nofile, nproc=$nproc, cgroupfs, file events, runc)"
}

# This machine's Debian mirror and security mirror, from its apt sources.
debian_mirrors() {
  local uris
  uris=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null |
         grep -oE '(URIs:[[:space:]]*|^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?)[a-z]+://[^[:space:]]+' |
         grep -oE '[a-z]+://[^[:space:]]+' || true)
  mirror=$(grep -v -- '-security' <<<"$uris" | grep -E '/debian/?$' | head -1 || true)
  security=$(grep -- '-security' <<<"$uris" | head -1 || true)
  mirror=${mirror:-http://deb.debian.org/debian}
  security=${security:-http://deb.debian.org/debian-security}
}

make_base_image() {
  local engine=$1
  apt_install debootstrap
  debian_mirrors
  local root
  root=$(mktemp -d /var/tmp/modelavg-rootfs.XXXXXX)
  # shellcheck disable=SC2064
  trap "$sudo rm -rf '$root'" EXIT
  say "no registry reachable: making ${BASE_TAGS[*]} with debootstrap from $mirror"
  local start=$SECONDS
  $sudo debootstrap --variant=minbase bookworm "$root/fs" "$mirror" >"$root/debootstrap.log" 2>&1 || {
    tail -20 "$root/debootstrap.log" >&2
    echo "container_setup: debootstrap failed (log above)" >&2
    exit 1
  }
  # Like the official image: the release, its updates and security, and no apt caches.
  $sudo rm -f "$root/fs/etc/apt/sources.list"
  $sudo tee "$root/fs/etc/apt/sources.list.d/debian.sources" >/dev/null <<EOF
Types: deb
URIs: $mirror
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  $sudo rm -rf "$root"/fs/var/lib/apt/lists/* "$root"/fs/var/cache/apt/*.bin \
    "$root"/fs/var/cache/apt/archives/*.deb "$root"/fs/var/log/* "$root"/fs/tmp/*
  local out
  out=$($sudo tar -C "$root/fs" --numeric-owner -c . |
        $sudo "$engine" import --change 'CMD ["bash"]' - "${BASE_TAGS[0]}" 2>&1) || {
    echo "$out" >&2
    echo "container_setup: $engine import failed (output above)" >&2
    exit 1
  }
  for tag in "${BASE_TAGS[@]:1}"; do $sudo "$engine" tag "${BASE_TAGS[0]}" "$tag"; done
  $sudo rm -rf "$root"
  trap - EXIT
  say "made ${BASE_TAGS[*]} in $((SECONDS - start)) s ($($sudo "$engine" image inspect \
    --format '{{.Size}}' "${BASE_TAGS[0]}" | awk '{printf "%d MB", $1 / 1e6}'))"
}

start=$SECONDS
detect
if [ -z "$engine" ]; then
  if [ -n "${MODELAVG_CONTAINER_ENGINE:-}" ] && [ "$MODELAVG_CONTAINER_ENGINE" != podman ]; then
    echo "container_setup: $why" >&2
    exit 1
  fi
  say "$why: setting up podman"
  apt_install "${PODMAN_PACKAGES[@]}"
  write_podman_conf
  podman_usable || { podman info >&2 || true; echo "container_setup: podman info fails" >&2; exit 1; }
  engine=podman
elif [ "$engine" = podman ]; then
  say "using podman $(podman version --format '{{.Client.Version}}')"
  apt_install "${PODMAN_PACKAGES[@]}"
  write_podman_conf
else
  say "using docker $(docker version --format '{{.Server.Version}}' 2>/dev/null)"
fi
compose=$(compose_for "$engine")
if [ -z "$compose" ]; then
  apt_install docker-compose
  compose=$(compose_for "$engine")
fi
[ -n "$compose" ] || { echo "container_setup: no compose command for $engine" >&2; exit 1; }
say "compose command: $compose"

missing_tags=()
for tag in "${BASE_TAGS[@]}"; do has_image "$engine" "$tag" || missing_tags+=("$tag"); done
if [ ${#missing_tags[@]} -eq 0 ]; then
  say "base images ${BASE_TAGS[*]} present"
else
  pulled=1
  for tag in "${missing_tags[@]}"; do
    if timeout 120 $sudo "$engine" pull "docker.io/library/$tag" >/dev/null 2>&1; then
      $sudo "$engine" tag "docker.io/library/$tag" "$tag" 2>/dev/null || true
      say "pulled $tag"
    else
      pulled=0
      break
    fi
  done
  [ $pulled -eq 1 ] || make_base_image "$engine"
fi

out=$(timeout 120 $sudo "$engine" run --rm "${BASE_TAGS[1]}" cat /etc/debian_version 2>&1) || {
  echo "$out" >&2
  echo "container_setup: a $engine container does not start (output above)" >&2
  exit 1
}
say "a container runs (Debian $out); ready in $((SECONDS - start)) s: engine=$engine compose=$compose"
