#!/usr/bin/env python3
"""The README's Layout section against include/shardsafe (issue 52): every header folder is
mentioned, every folder it mentions exists, and every header is named in its folder's lines (a
folder's header by its stem, a top-level one as NAME.hpp). Usage: check_readme_layout.py ROOT."""
import re, os, sys
root = sys.argv[1]
readme = open(os.path.join(root, 'README.md')).read()
blk = readme.split('## Layout', 1)[1].split('```', 2)[1]
lines = blk.split('\n')
i0 = next(i for i, l in enumerate(lines) if l.startswith('include/shardsafe/'))
i1 = next(i for i in range(i0 + 1, len(lines)) if lines[i] and not lines[i].startswith(' '))
inc = lines[i0 + 1:i1]
blocks = {}; cur = None
for l in inc:
    m = re.match(r'^  ([a-z_/]+/)\s', l)
    if m: cur = m.group(1).rstrip('/'); blocks[cur] = l[len(m.group(0)):]
    elif l.startswith('  ') and not l.startswith('    ') : cur = '.'; blocks.setdefault('.', ''); blocks['.'] += ' ' + l
    else: blocks[cur] += ' ' + l
bad = 0
hdrs = []
for dp, dn, fn in os.walk(os.path.join(root, 'include/shardsafe')):
    for f in fn:
        rel = os.path.relpath(os.path.join(dp, f), os.path.join(root, 'include/shardsafe'))
        if f.endswith('.hpp'): hdrs.append(rel)
dirs = {os.path.dirname(h) or '.' for h in hdrs}
for d in sorted(dirs):
    if d not in blocks: print('README Layout: folder not mentioned:', d, file=sys.stderr); bad += 1
for d in blocks:
    if not os.path.isdir(os.path.join(root, 'include/shardsafe', d)): print('README Layout: listed folder missing:', d, file=sys.stderr); bad += 1
for h in sorted(hdrs):
    d = os.path.dirname(h) or '.'; stem = os.path.basename(h)[:-4]
    text = blocks.get(d, '')
    if d == '.': ok = re.search(r'(?<![\w/])' + re.escape(stem) + r'\.hpp', text)
    else: ok = re.search(r'(?<![\w/.-])' + re.escape(stem) + r'(?![\w/])', text)
    if not ok: print('README Layout: header not listed:', h, file=sys.stderr); bad += 1
if bad:
    print(f"README.md's Layout section and include/shardsafe differ in {bad} place(s) (above)", file=sys.stderr)
    sys.exit(1)
print(f"README: its Layout section names every folder and each of the {len(hdrs)} headers under include/shardsafe")
