#!/usr/bin/env bash
# The second toolchain environment: a Debian 13 (trixie) root with GCC 14, LibTorch 2.6,
# Python's torch 2.6, python3-safetensors, Boost 1.83, simdjson, doctest, meson and moto.
#
#   scripts/env-debian13.sh make [GROUP...]   make the root (once; a marker file says it is
#                                             there) and install the package groups named
#   scripts/env-debian13.sh run CMD [ARG...]  run CMD inside it, in this checkout (same path)
#   scripts/env-debian13.sh path              print the root's path
#
# GROUP: base (python3-torch, python3-safetensors: the Python peer), build (g++ 14, libtorch-dev,
# Boost, simdjson, doctest, meson, ...), moto (python3-moto), peers (base and what DeepSpeed's and
# Megatron-LM's sources import: tests/peers/). `make` with no group installs base.
# Each group is installed once (a marker file per group, holding its package list: a list that
# changes is installed again), so a leg installs only what it needs.
#
# The root is made with debootstrap from the Debian archive this machine's apt already uses (read
# from /etc/apt/sources.list.d/ or /etc/apt/sources.list; no host is written here). It lives in
# $SHARDSAFE_DEBIAN13_ROOT (default /var/cache/shardsafe/debian13), outside the checkout, so that
# every clone on the machine shares it. `run` works in a private mount namespace (unshare -m):
# the bind mounts of /proc, /sys, /dev, /dev/shm, /tmp and the checkout vanish with the command,
# whatever way it ends. Debian's torch 2.6 is built without libuv: USE_LIBUV=0 is set for its
# TCPStore. Needs root (debootstrap, chroot, mounts).
set -euo pipefail

root="${SHARDSAFE_DEBIAN13_ROOT:-/var/cache/shardsafe/debian13}"
here="$(cd "$(dirname "$0")/.." && pwd)"

die() { echo "env-debian13: $*" >&2; exit 1; }

# The archive apt uses here: the first URI of a deb822 source whose suites are Debian's, else
# the first `deb` line of sources.list.
mirror() {
  local m=""
  if compgen -G "/etc/apt/sources.list.d/*.sources" >/dev/null; then
    m=$(awk 'tolower($1)=="uris:" && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list.d/*.sources)
  fi
  if [ -z "$m" ] && [ -f /etc/apt/sources.list ]; then
    m=$(awk '$1=="deb" && $0 !~ /security/ { for (i=2;i<=NF;i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit} }' /etc/apt/sources.list)
  fi
  [ -n "$m" ] || die "no Debian archive found in /etc/apt/sources.list.d/ or /etc/apt/sources.list"
  echo "$m"
}

group_packages() {
  case "$1" in
    base) echo python3-torch python3-safetensors python3-numpy ;;
    build) echo g++ make meson ninja-build pkg-config cmake libtorch-dev libgloo-dev libsimdjson-dev \
             libxxhash-dev libboost-dev doctest-dev libssl-dev libcli11-dev libre2-dev python3 ;;
    moto) echo python3-moto ;;
    # the trainers run as peers (tests/peers/): DeepSpeed's and Megatron-LM's imports
    peers) echo python3-torch python3-safetensors python3-numpy python3-hjson python3-msgpack \
             python3-psutil python3-cpuinfo python3-pydantic python3-einops python3-tqdm \
             python3-packaging python3-yaml python3-regex ;;
    *) die "unknown package group '$1' (base, build, moto, peers)" ;;
  esac
}

# Runs a command in the root with the pseudo file systems bound, in a mount namespace of its
# own (so nothing stays mounted after it, even when it is killed).
in_root() {
  unshare --mount --propagation private -- bash -c '
    set -e
    r="$1"; shift; src="$1"; shift
    for d in proc sys dev dev/shm tmp; do mkdir -p "$r/$d"; done
    mount --rbind /proc "$r/proc"; mount --rbind /sys "$r/sys"
    mount --rbind /dev "$r/dev"; mount --bind /dev/shm "$r/dev/shm"
    mount --bind /tmp "$r/tmp"
    mkdir -p "$r$src"; mount --bind "$src" "$r$src"
    cp -L /etc/resolv.conf "$r/etc/resolv.conf" 2>/dev/null || true
    exec chroot "$r" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
      USE_LIBUV=0 SHARDSAFE_REQUIRE_PYTHON="${SHARDSAFE_REQUIRE_PYTHON:-}" \
      SHARDSAFE_ENV=debian13 FUZZ_SECONDS="${FUZZ_SECONDS:-}" SHARDSAFE_TORCH_PEER="${SHARDSAFE_TORCH_PEER:-}" \
      bash -c "cd \"\$0\" && exec \"\$@\"" "$src" "$@"
  ' in_root "$root" "$here" "$@"
}

make_root() {
  [ "$(id -u)" -eq 0 ] || die "making the root needs root (debootstrap, chroot)"
  if [ ! -f "$root/.shardsafe-root" ]; then
    command -v debootstrap >/dev/null || {
      . "$(dirname "${BASH_SOURCE[0]}")/apt.sh"
      apt_get update -q && apt_get install -y -q --no-install-recommends debootstrap
    }
    local m; m=$(mirror)
    echo "env-debian13: making the Debian 13 root in $root from $m (several minutes)"
    rm -rf "$root"; mkdir -p "$root"
    debootstrap --variant=minbase trixie "$root" "$m" >"$root.debootstrap.log" 2>&1 ||
      { tail -20 "$root.debootstrap.log" >&2; die "debootstrap failed (log: $root.debootstrap.log)"; }
    printf 'deb %s trixie main\n' "$m" >"$root/etc/apt/sources.list"
    # a scratch root: dpkg need not fsync each of the packages' files (the torch packages hold
    # tens of thousands), and apt fetches no translations
    printf 'force-unsafe-io\n' >"$root/etc/dpkg/dpkg.cfg.d/shardsafe-unsafe-io"
    printf 'Acquire::Languages "none";\n' >"$root/etc/apt/apt.conf.d/99shardsafe"
    touch "$root/.shardsafe-root"
  fi
  local g todo=() groups=("$@")
  [ ${#groups[@]} -gt 0 ] || groups=(base)
  # a group's marker holds its package list: a group whose list changed since is installed again
  for g in "${groups[@]}"; do
    [ "$(cat "$root/.shardsafe-$g" 2>/dev/null)" = "$(group_packages "$g")" ] || todo+=("$g")
  done
  [ ${#todo[@]} -gt 0 ] || return 0
  local pkgs=()
  for g in "${todo[@]}"; do read -r -a p <<<"$(group_packages "$g")"; pkgs+=("${p[@]}"); done
  echo "env-debian13: installing ${todo[*]}: ${pkgs[*]}"
  if [ ! -f "$root/.shardsafe-apt-updated" ]; then
    in_root env DEBIAN_FRONTEND=noninteractive apt-get update -q
    touch "$root/.shardsafe-apt-updated"
  fi
  in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${pkgs[@]}"
  in_root apt-get clean
  for g in "${todo[@]}"; do group_packages "$g" >"$root/.shardsafe-$g"; done
}

case "${1:-}" in
  make) shift; make_root "$@" ;;
  run)
    shift; [ $# -gt 0 ] || die "run: no command"
    [ -f "$root/.shardsafe-root" ] || die "no root at $root: scripts/env-debian13.sh make first"
    in_root "$@" ;;
  path) echo "$root" ;;
  *) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
