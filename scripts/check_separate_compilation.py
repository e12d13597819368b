#!/usr/bin/env python3
"""Separate compilation as Asio's (include/shardsafe/core/config.hpp), checked on the text of
the headers, so that it holds in both modes: check_layering.sh runs it. Usage:
check_separate_compilation.py INCLUDE_DIR.

  - no header or implementation file names the old guards (SHARDSAFE_ followed by DEFINE or
    REMOTE_DEFINE: a body chosen by the preprocessor);
  - a header declares each function compiled once (SHARDSAFE_DECL) once, without a body: the
    body is in its implementation file, never in the header (a function written twice);
  - an implementation file is AREA/impl/NAME.ipp beside the header AREA/NAME.hpp; it starts with
    a one-line comment and #pragma once, includes its header first, and holds definitions only;
  - the header includes it at its very end under SHARDSAFE_HEADER_ONLY, and nothing else but
    exactly one unit of separate compilation (shardsafe/compiled.hpp or
    shardsafe/compiled_remote.hpp) includes it;
  - a header that declares a function SHARDSAFE_DECL has an implementation file."""
import os, re, sys

root = sys.argv[1] if len(sys.argv) > 1 else 'include'
units = ['shardsafe/compiled.hpp', 'shardsafe/compiled_remote.hpp']
files = {}
for d, _, fs in os.walk(os.path.join(root, 'shardsafe')):
    for f in fs:
        if f.endswith(('.hpp', '.ipp')):
            full = os.path.join(d, f)
            files[os.path.relpath(full, root)] = open(full, encoding='utf-8').read()

problems = []
old_guard = re.compile(r'\bSHARDSAFE_(REMOTE_)?DEFINE\b')
include_re = re.compile(r'^\s*#\s*include\s*[<"](shardsafe/[^">]+)[">]', re.M)


def code(text):
    """text without comments and string literals (kept the same length for line numbers)"""
    out = re.sub(r'//[^\n]*|/\*.*?\*/', lambda m: re.sub(r'[^\n]', ' ', m.group(0)), text, flags=re.S)
    return re.sub(r'"(\\.|[^"\\\n])*"', lambda m: '"' + ' ' * (len(m.group(0)) - 2) + '"', out)


def decls(text):
    """(line, normalized declaration, has a body) of each SHARDSAFE_DECL in text"""
    c = code(text)
    out = []
    for m in re.finditer(r'\bSHARDSAFE_DECL\b', c):
        if re.match(r'\s*#\s*define\b', c[c.rfind('\n', 0, m.start()) + 1:m.start()] + ' '):
            continue
        i, depth = m.end(), 0
        while i < len(c):
            ch = c[i]
            if ch in '([':
                depth += 1
            elif ch in ')]':
                depth -= 1
            elif depth == 0 and ch in ';{':
                break
            elif depth == 0 and ch == ':' and c[i + 1] != ':' and c[i - 1] != ':':  # a constructor's initializers
                ch = '{'
                break
            i += 1
        sig = ' '.join(c[m.end():i].split())
        body = ch == '{' or re.search(r'=\s*(default|delete)$', sig) is not None  # (a defaulted destructor)
        out.append((c.count('\n', 0, m.start()) + 1, sig, body))
    return out


for p, text in sorted(files.items()):
    for n, line in enumerate(text.split('\n'), 1):
        if old_guard.search(line):
            problems.append(f'{p}:{n}: names the old guard of separate compilation; declare the function once '
                            f'(SHARDSAFE_DECL) and define it in impl/*.ipp (core/config.hpp)')

for p, text in sorted(files.items()):
    if not p.endswith('.hpp'):
        continue
    seen = {}
    for n, sig, body in decls(text):
        if body:
            problems.append(f'{p}:{n}: a SHARDSAFE_DECL function defined in a header: declare it here, define it '
                            f'in {os.path.dirname(p)}/impl/{os.path.basename(p)[:-4]}.ipp')
        elif sig in seen:
            problems.append(f'{p}:{n}: SHARDSAFE_DECL {sig[:60]}... declared twice (also line {seen[sig]})')
        else:
            seen[sig] = n

includers = {}
for p, text in files.items():
    for m in include_re.finditer(text):
        includers.setdefault(m.group(1), []).append(p)

ipps = sorted(p for p in files if p.endswith('.ipp'))
for ipp in ipps:
    m = re.fullmatch(r'(shardsafe/(?:.+/)?)impl/([a-z0-9_]+)\.ipp', ipp)
    if not m:
        problems.append(f'{ipp}: an implementation file lives in an impl/ folder beside its header: AREA/impl/NAME.ipp')
        continue
    header = m.group(1) + m.group(2) + '.hpp'
    text = files[ipp]
    if header not in files:
        problems.append(f'{ipp}: no header {header} beside its impl/ folder')
        continue
    lines = text.split('\n')
    if not (lines[0].startswith('// ') and lines[1] == '#pragma once'):
        problems.append(f'{ipp}: starts with a one-line comment, then #pragma once')
    incs = include_re.findall(text)
    if not incs or incs[0] != header:
        problems.append(f'{ipp}: includes its header {header} first')
    for n, sig, body in decls(text):
        if not body:
            problems.append(f'{ipp}:{n}: a declaration without a body: declare it in {header}, define it here')
    tail = [l for l in files[header].rstrip('\n').split('\n')[-3:]]
    want = ['#if defined(SHARDSAFE_HEADER_ONLY)', f'#include "{ipp}"', '#endif']
    if tail != want:
        problems.append(f'{header}: ends with ' + ' / '.join(want) + ' (the implementation file, header-only)')
    who = includers.get(ipp, [])
    in_units = [u for u in who if u in units]
    others = [w for w in who if w not in units and w != header]
    if len(in_units) != 1:
        problems.append(f'{ipp}: included by {len(in_units)} units of separate compilation ({", ".join(in_units) or "none"}); '
                        f'exactly one of {" and ".join(units)} compiles it')
    if others:
        problems.append(f'{ipp}: included by {", ".join(sorted(others))}: only its header (header-only) and its unit include it')

for p, text in sorted(files.items()):
    if p.endswith('.hpp') and p not in units and any(not body for _, _, body in decls(text)):
        ipp = f'{os.path.dirname(p)}/impl/{os.path.basename(p)[:-4]}.ipp'
        if ipp not in files:
            problems.append(f'{p}: declares functions SHARDSAFE_DECL but has no {ipp} defining them')

if problems:
    print('layering: separate compilation (core/config.hpp) is not as Asio\'s in these places:', file=sys.stderr)
    for pr in problems:
        print('  ' + pr, file=sys.stderr)
    sys.exit(1)
ndecl = sum(len(decls(files[p])) for p in ipps)
print(f'layering: {len(ipps)} implementation files (impl/*.ipp, {ndecl} functions compiled once), each included by its '
      f'header header-only and by one unit of separate compilation; no function written twice')
