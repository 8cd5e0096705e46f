#!/usr/bin/env python3
"""Writes a JSONL corpus of real English text for bench/preprocess_bench.sh: Perl's documentation
(Debian perl-doc, /usr/share/perl/5.*/pod/*.pod), one document per "=head1" section, the whole set
repeated until the file reaches --megabytes. Usage: make_pod_corpus.py OUT.jsonl [--megabytes 150]"""
import argparse
import glob
import json
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--megabytes", type=float, default=150)
args = parser.parse_args()

files = sorted(glob.glob("/usr/share/perl/5.*/pod/*.pod"))
if not files:
    sys.exit("no pod files under /usr/share/perl/5.*/pod (install Debian's perl-doc)")
docs = []
for f in files:
    text = open(f, encoding="utf-8", errors="replace").read()
    parts = text.split("\n=head1 ")
    docs += [parts[0]] + ["=head1 " + p for p in parts[1:]]
lines = [json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs if d.strip()]
target = int(args.megabytes * 1024 * 1024)
written = 0
with open(args.out, "w", encoding="utf-8") as out:
    while written < target:
        for line in lines:
            out.write(line)
            written += len(line.encode("utf-8"))
            if written >= target:
                break
print(f"{args.out}: {os.path.getsize(args.out) / 1e6:.1f} MB", file=sys.stderr)
