#!/usr/bin/env python3
"""Compile-fail tests: each CASE of a snippet file is compiled with the command the build uses
for a core test source (from BUILD/compile_commands.json: the project's compiler, flags and
include directories), with -fsyntax-only and -DCASE=N. CASE 0 must compile; every other case
must fail with the text after `// expect:` on its `#elif CASE == N` line in the compiler's
output. Usage: run.py BUILD_DIR REFERENCE_SOURCE SNIPPET..."""
import json
import os
import re
import shlex
import subprocess
import sys


def main():
    build, reference, snippets = sys.argv[1], sys.argv[2], sys.argv[3:]
    with open(os.path.join(build, "compile_commands.json")) as f:
        entries = json.load(f)
    ref = next((e for e in entries if e["file"].endswith(reference)), None)
    if ref is None:
        print(f"no compile command for {reference} in {build}/compile_commands.json")
        return 1
    args = ref["arguments"] if "arguments" in ref else shlex.split(ref["command"])
    # drop the output, the dependency file options and the source; keep compiler and flags
    keep, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MQ", "-MT", "-c"):
            skip = a != "-c"
            continue
        if a in ("-MD", "-MMD") or a.endswith(reference) or a.endswith(ref["file"]):
            continue
        if a.startswith("-Winvalid-pch") or a == "-include" or a.endswith(".pch"):
            continue
        keep.append(a)
    failures = 0
    for snippet in snippets:
        text = open(snippet).read()
        cases = {0: None}
        for m in re.finditer(r"#elif CASE == (\d+)\s*//\s*expect:\s*(.+)", text):
            cases[int(m.group(1))] = m.group(2).strip()
        for case, expect in sorted(cases.items()):
            cmd = keep + ["-fsyntax-only", f"-DCASE={case}", os.path.abspath(snippet)]
            p = subprocess.run(cmd, cwd=ref["directory"], capture_output=True, text=True)
            out = p.stdout + p.stderr
            name = f"{os.path.basename(snippet)} CASE {case}"
            if expect is None:
                ok = p.returncode == 0
                why = "" if ok else "the correct use does not compile:\n" + out[-3000:]
            else:
                ok = p.returncode != 0 and expect in out
                why = "" if ok else (f"compiled, but must fail with '{expect}'" if p.returncode == 0
                                     else f"failed without '{expect}':\n" + out[-3000:])
            print(f"{'ok  ' if ok else 'FAIL'} {name}" + ("" if ok else ": " + why))
            failures += not ok
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
