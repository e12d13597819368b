"""What the Python benches (dcp_permuted.py, torch_bin.py) share: their command line and the
peak RSS of a command run alone; and the Python peers (dcp_peer.py, layouts_peer.py) this
process's RSS."""
import collections
import os
import subprocess
import sys
import tempfile

Args = collections.namedtuple("Args", "tool quick reps base tests")


def bench_args(argv, doc, name):
    """TOOL [--quick] [--reps N] [--dir DIR]: the tool, whether quick, the rounds (1 quick, else
    3), a new scratch folder under DIR and the tests folder (for torch_compat); exits with doc
    when TOOL is not an executable."""
    if len(argv) < 1 or not os.access(argv[0], os.X_OK):
        sys.exit(doc)
    quick = "--quick" in argv
    reps = int(argv[argv.index("--reps") + 1]) if "--reps" in argv else (1 if quick else 3)
    base = tempfile.mkdtemp(prefix=f"shardsafe-bench-{name}-", dir=argv[argv.index("--dir") + 1] if "--dir" in argv else None)
    tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
    return Args(argv[0], quick, reps, base, tests)


def peak_mib_of(args):
    """Runs args alone under /usr/bin/time and returns its peak RSS in MiB (NaN without it: a
    child's own rusage would count the memory of the bench it was forked from). Exits naming
    the command when it fails."""
    if not os.access("/usr/bin/time", os.X_OK):
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
        return float("nan")
    r = subprocess.run(["/usr/bin/time", "-f", "%M"] + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if r.returncode != 0:
        sys.exit(os.path.basename(sys.argv[0]) + ": " + " ".join(args) + " failed:\n" + r.stderr.decode())
    return int(r.stderr.split()[-1]) / 1024.0


def rss_mib():
    """This process's resident set (VmRSS) in MiB, 0 where /proc says nothing."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0
