"""Checks that every snippet of docs/USAGE.md is, byte for byte, a region of a source the tests compile
and run: a `<!-- snippet: PATH#NAME -->` line, then a ```cpp block, equal to the lines between
`// [usage: NAME]` and `// [/usage]` in PATH (their common indentation removed).

    python3 tests/usage_check.py SOURCE_DIR

Exit 0 when all match (and there is at least one); 1 naming the first that differs.
"""
import os
import re
import sys
import textwrap


def regions(path):
    out, name, lines = {}, None, []
    with open(path) as f:
        for line in f:
            m = re.match(r"\s*// \[usage: (\w+)\]\s*$", line)
            if m:
                name, lines = m.group(1), []
            elif re.match(r"\s*// \[/usage\]\s*$", line) and name:
                out[name] = textwrap.dedent("".join(lines))
                name = None
            elif name:
                lines.append(line)
    return out


def main(src):
    doc = open(os.path.join(src, "docs", "USAGE.md")).read()
    found = re.findall(r"<!-- snippet: ([^#\s]+)#(\w+) -->\n```cpp\n(.*?)```", doc, re.S)
    if not found:
        print("usage_check: docs/USAGE.md holds no snippet")
        return 1
    cache = {}
    for path, name, text in found:
        if path not in cache:
            cache[path] = regions(os.path.join(src, path))
        have = cache[path].get(name)
        if have is None:
            print(f"usage_check: {path} has no region '{name}' (docs/USAGE.md shows one)")
            return 1
        if have != text:
            print(f"usage_check: docs/USAGE.md's snippet {path}#{name} differs from the source:\n--- doc\n{text}--- source\n{have}")
            return 1
    print(f"usage_check: {len(found)} snippets of docs/USAGE.md are compiled and run by the tests")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
