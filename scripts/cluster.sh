#!/usr/bin/env bash
# A cluster on one machine: network namespaces as nodes on a switch of their own.
#
#   scripts/cluster.sh up NAME NODES [RATE [DELAY]]   make it (removing an older one of that name)
#   scripts/cluster.sh down NAME                       kill what runs in it and remove it all
#   scripts/cluster.sh run NAME NODE CMD [ARG...]      run CMD on node NODE (0-based)
#   scripts/cluster.sh addr NAME NODE                  the node's address
#   scripts/cluster.sh cut NAME NODE | heal NAME NODE  take the node's link down (a partition) / up
#   scripts/cluster.sh links NAME                      what the links were given (rate, delay)
#   scripts/cluster.sh rate NAME NODE RATE             give one node's link another rate (a slow store)
#
# Node K is the namespace NAME-nK with one interface, eth0, at 10.213.0.(K+1)/24, and a loopback.
# The switch is the namespace NAME-sw: a bridge with one port per node. Nothing is added to the
# host's own network (its addresses, routes and interfaces stay as they are): the addresses exist
# only inside namespaces this script made, and only the nodes of one cluster see each other.
# The host's file systems are the cluster's shared file system (namespaces share them).
#
# RATE (e.g. 10gbit, default 10gbit) limits each link in both directions; DELAY (e.g. 1ms,
# default 1ms) is added in both directions where the kernel has the netem queueing discipline.
# Where it has not (no sch_netem), the links get the rate alone (tbf) and `links` says so.
# Needs root (ip netns, tc).
set -euo pipefail

die() { echo "cluster: $*" >&2; exit 1; }
[ $# -ge 2 ] || { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
cmd="$1"; name="$2"; shift 2
case "$name" in *[!a-z0-9]*|"") die "NAME '$name': lowercase letters and digits only" ;; esac
[ ${#name} -le 8 ] || die "NAME '$name': 8 characters at most (interface names are short)"
state="/run/shardsafe-cluster/$name"

node_addr() { echo "10.213.0.$(($1 + 1))"; }

# limits one interface's egress (run inside its namespace): netem (delay and rate) where the
# kernel has it, else tbf (rate); prints which
limit_link() {
  local ns="$1" dev="$2" rate="$3" delay="$4"
  if ip netns exec "$ns" tc qdisc replace dev "$dev" root netem delay "$delay" rate "$rate" limit 100000 2>/dev/null; then
    echo "netem delay $delay rate $rate"
  else
    ip netns exec "$ns" tc qdisc replace dev "$dev" root tbf rate "$rate" burst 1mb latency 100ms
    echo "tbf rate $rate (no netem in this kernel: no delay)"
  fi
}

down() {
  local ns
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^$name-(n[0-9]+|sw)$" || true); do
    # whatever still runs on the node goes first (a namespace with processes in it stays)
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -rf "$state"
}

up() {
  local nodes="$1" rate="${2:-10gbit}" delay="${3:-1ms}"
  [[ "$nodes" =~ ^[0-9]+$ ]] && [ "$nodes" -ge 1 ] && [ "$nodes" -le 200 ] || die "NODES '$nodes': 1 to 200"
  [ "$(id -u)" -eq 0 ] || die "needs root (network namespaces)"
  command -v ip >/dev/null && command -v tc >/dev/null || die "needs ip and tc (iproute2)"
  down
  mkdir -p "$state"
  # removed again if any step below fails
  trap 'down' ERR
  local sw="$name-sw" k ns how=""
  ip netns add "$sw"
  ip -n "$sw" link add br0 type bridge
  ip -n "$sw" link set br0 up
  ip -n "$sw" link set lo up
  for ((k = 0; k < nodes; k++)); do
    ns="$name-n$k"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip link add "$name-e$k" netns "$ns" type veth peer name "p$k" netns "$sw"
    ip -n "$ns" link set "$name-e$k" name eth0
    ip -n "$ns" addr add "$(node_addr "$k")/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$sw" link set "p$k" master br0
    ip -n "$sw" link set "p$k" up
    how=$(limit_link "$ns" eth0 "$rate" "$delay")
    limit_link "$sw" "p$k" "$rate" "$delay" >/dev/null
  done
  trap - ERR
  echo "$nodes" >"$state/nodes"
  echo "$how" >"$state/links"
  echo "cluster $name: $nodes nodes at $(node_addr 0)..$(node_addr $((nodes - 1))), links: $how"
}

node_ns() {
  local k="$1"
  [[ "$k" =~ ^[0-9]+$ ]] || die "NODE '$k' is not a number"
  [ -f "$state/nodes" ] || die "no cluster '$name' (scripts/cluster.sh up $name N)"
  [ "$k" -lt "$(cat "$state/nodes")" ] || die "cluster '$name' has no node $k"
  echo "$name-n$k"
}

case "$cmd" in
  up) [ $# -ge 1 ] || die "up NAME NODES [RATE [DELAY]]"; up "$@" ;;
  down) down ;;
  run) [ $# -ge 2 ] || die "run NAME NODE CMD..."; ns=$(node_ns "$1"); shift; exec ip netns exec "$ns" "$@" ;;
  addr) [ $# -eq 1 ] || die "addr NAME NODE"; node_ns "$1" >/dev/null; node_addr "$1" ;;
  cut) [ $# -eq 1 ] || die "cut NAME NODE"; node_ns "$1" >/dev/null; ip -n "$name-sw" link set "p$1" down ;;
  heal) [ $# -eq 1 ] || die "heal NAME NODE"; node_ns "$1" >/dev/null; ip -n "$name-sw" link set "p$1" up ;;
  links) [ -f "$state/links" ] || die "no cluster '$name'"; cat "$state/links" ;;
  rate)
    [ $# -eq 2 ] || die "rate NAME NODE RATE"
    ns=$(node_ns "$1")
    limit_link "$ns" eth0 "$2" 1ms >/dev/null
    limit_link "$name-sw" "p$1" "$2" 1ms
    ;;
  *) die "unknown command '$cmd' (up, down, run, addr, cut, heal, links)" ;;
esac
