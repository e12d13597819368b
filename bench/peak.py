"""The peak RSS of a command run alone, for the Python benches (dcp_permuted.py, torch_bin.py)."""
import os
import subprocess
import sys


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
