#!/usr/bin/env bash
# scripts/apt.sh waits for a lock another process holds, bounded, and says so (issue 53: the
# README's commands on a machine where unattended upgrades hold the dpkg lock). The locks are
# files of this test's own (SHARDSAFE_APT_LOCKS), held as dpkg holds its own: a POSIX lock
# (fcntl, as dpkg and apt take them) and, for the lists, a flock; nothing of the system's is
# touched. Fails when the wait returns while the lock is held, or waits past its bound.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
. "$here/scripts/apt.sh"
tmp=$(mktemp -d)
holders=()
# (each holder's children too: flock's sleep would keep the test's output open, and meson waiting)
cleanup() {
  for p in "${holders[@]}"; do pkill -P "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "test_apt_lock: $*" >&2; exit 1; }
export SHARDSAFE_APT_LOCKS="$tmp/lock-frontend $tmp/lists-lock"
touch "$tmp/lock-frontend" "$tmp/lists-lock"

# 1. nothing held: no wait, no message
out=$(apt_wait_locks 2>&1) || fail "apt_wait_locks failed with no lock held: $out"
[ -z "$out" ] || fail "apt_wait_locks spoke with no lock held: $out"

# 2. a POSIX lock (fcntl, as dpkg's lock-frontend), released after 3 s: waited for, then 0
python3 - "$tmp/lock-frontend" "$tmp/posix-held" <<'PY' >/dev/null 2>&1 &
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.lockf(fd, fcntl.LOCK_EX)
open(sys.argv[2], "w").close()
time.sleep(3)
PY
holders+=($!)
for _ in $(seq 100); do [ -e "$tmp/posix-held" ] && break; sleep 0.1; done
[ -n "$(apt_lock_holder)" ] || fail "a POSIX lock held on $tmp/lock-frontend is not seen"
out=$(SHARDSAFE_APT_WAIT=60 apt_wait_locks 2>&1) || fail "the wait gave up on a lock released after 3 s: $out"
grep -q "waiting for another package manager run" <<<"$out" || fail "the wait said nothing: $out"
grep -q "released after" <<<"$out" || fail "the wait did not say the lock was released: $out"
[ -z "$(apt_lock_holder)" ] || fail "apt_wait_locks returned while the lock is still held"

# 3. a flock held longer than the bound: gives up after the bound, naming the holder
flock "$tmp/lists-lock" sleep 30 </dev/null >/dev/null 2>&1 &
holders+=($!)
for _ in $(seq 100); do [ -n "$(apt_lock_holder)" ] && break; sleep 0.1; done
[ -n "$(apt_lock_holder)" ] || fail "a flock held on $tmp/lists-lock is not seen"
if out=$(SHARDSAFE_APT_WAIT=2 apt_wait_locks 2>&1); then fail "the wait succeeded while the lock is held: $out"; fi
grep -q "still holds a lock of dpkg or apt after 2 s" <<<"$out" || fail "the refusal does not say why: $out"
echo "test_apt_lock: waits for a held lock, gives up after its bound naming the holder"
