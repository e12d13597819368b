# scripts/apt.sh - apt-get that waits, bounded, for another package manager run to finish
# (sourced by deps.sh, test.sh and env-debian13.sh). A new cloud machine often runs unattended
# upgrades at boot: apt-get alone then fails at once with "Could not get lock
# /var/lib/dpkg/lock-frontend". Here every apt-get first waits until no process holds a lock of
# dpkg or apt (read from /proc/locks: no tool needed), saying who holds it every 30 s, for at
# most SHARDSAFE_APT_WAIT seconds (default 900), then fails naming the holder; apt-get itself
# also waits that long for the dpkg lock (DPkg::Lock::Timeout), should another run take it
# between the check and the call.
#
#   apt_wait_locks          returns 0 once no lock is held, 1 (with a message) after the bound
#   apt_get ARGS...         apt_wait_locks, then apt-get ARGS (with sudo when not root)
#
# SHARDSAFE_APT_LOCKS (space separated) replaces the lock files checked (the tests use files of
# their own).

apt_lock_files() {
  echo "${SHARDSAFE_APT_LOCKS:-/var/lib/dpkg/lock-frontend /var/lib/dpkg/lock /var/lib/apt/lists/lock /var/cache/apt/archives/lock}"
}

# The pid holding a lock on one of the lock files (a POSIX or flock lock), or nothing.
apt_lock_holder() {
  local f ino
  for f in $(apt_lock_files); do
    [ -e "$f" ] || continue
    ino=$(stat -L -c %i "$f")
    # /proc/locks: "N: POSIX ADVISORY WRITE PID MAJ:MIN:INODE START END" (waiters have "->" first)
    awk -v ino="$ino" '$2 != "->" { n = split($6, a, ":"); if (n == 3 && a[3] == ino) { print $5; exit } }' /proc/locks
  done | head -n 1
}

apt_wait_locks() {
  local bound="${SHARDSAFE_APT_WAIT:-900}" waited=0 pid
  pid=$(apt_lock_holder)
  [ -z "$pid" ] && return 0
  while [ -n "$pid" ]; do
    if [ "$waited" -ge "$bound" ]; then
      echo "apt: another package manager run (pid $pid: $(cat /proc/"$pid"/comm 2>/dev/null || echo '?')) still holds a lock of dpkg or apt after ${bound} s; giving up (SHARDSAFE_APT_WAIT sets the bound)" >&2
      return 1
    fi
    if [ $((waited % 30)) -eq 0 ]; then
      echo "apt: waiting for another package manager run to finish (pid $pid: $(cat /proc/"$pid"/comm 2>/dev/null || echo '?') holds a lock of dpkg or apt; ${waited} s of at most ${bound} s)" >&2
    fi
    sleep 1
    waited=$((waited + 1))
    pid=$(apt_lock_holder)
  done
  echo "apt: the lock was released after ${waited} s" >&2
}

apt_get() {
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  apt_wait_locks || return 1
  DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout="${SHARDSAFE_APT_WAIT:-900}" "$@"
}
