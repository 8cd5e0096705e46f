#!/usr/bin/env python3
"""Writes a JSONL corpus of real English text: the system's English manual pages (man1-man8 under
/usr/share/man), each rendered to plain text by groff, one document per page, distinct pages only
(no repetition), until the file reaches --megabytes. The layout goes: each line's indentation, runs
of spaces and blank lines, and the page's running header and footer (so the tokens are words, not
the terminal layout's whitespace). For the FP8 loss check at a larger batch,
where bench/make_pod_corpus.py's Perl documentation (about 9 MB, repeated) would be read many times
over. Usage: make_man_corpus.py OUT.jsonl [--megabytes 60] [--jobs 2]"""
import argparse
import glob
import gzip
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--megabytes", type=float, default=60)
parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
args = parser.parse_args()

seen, pages = set(), []
for path in sorted(glob.glob("/usr/share/man/man[1-8]/*")):
    real = os.path.realpath(path)
    if real in seen or not os.path.isfile(real):
        continue
    seen.add(real)
    pages.append(real)
if not pages:
    sys.exit("no manual pages under /usr/share/man/man[1-8] (install man-db and manpages)")


def render(path):
    try:
        src = gzip.open(path).read() if path.endswith(".gz") else open(path, "rb").read()
    except OSError:
        return ""
    if src.lstrip().startswith(b".so "):  # a page that only points at another one
        return ""
    r = subprocess.run(["groff", "-man", "-Tutf8", "-P-cbou"], input=src, capture_output=True,
                       env=dict(os.environ, MANWIDTH="80"))
    return r.stdout.decode("utf-8", errors="replace")


def clean(text):
    lines = [" ".join(line.split()) for line in text.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    if len(lines) > 2:  # the running header ("LS(1)  User Commands  LS(1)") and footer
        lines = lines[1:-1]
    out, blank = [], False
    for line in lines:
        if line:
            out.append(line)
            blank = False
        elif not blank and out:
            out.append("")
            blank = True
    return "\n".join(out).strip() + "\n"


target = int(args.megabytes * 1024 * 1024)
written = docs = 0
with open(args.out, "w", encoding="utf-8") as out, ThreadPoolExecutor(args.jobs) as pool:
    for text in pool.map(render, pages, chunksize=16):
        text = clean(text)
        if len(text) < 1000:  # stubs and failed renders
            continue
        line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
        out.write(line)
        written += len(line.encode("utf-8"))
        docs += 1
        if written >= target:
            break
print(f"{args.out}: {docs} manual pages, {written / 1048576:.1f} MiB (of {len(pages)} pages found)")
