#!/usr/bin/env python3
"""Oracle for data/json_line.h: reads a JSONL file the way Megatron's tools/preprocess_data.py
does (each line through json.loads) and prints one line per input line: "ERR <message>: column
<pos + 1> (char <pos>)" (json.JSONDecodeError's message and position as our parser words them, a
JSONL line being one line; Python's own text adds "line 1"), "NOTOBJ" for a
valid line that is not an object, else "OK " and the "text" key: missing, other, str:<hex of its
UTF-8> or list:<hex>,<hex>,... (a lone surrogate as U+FFFD, as our parser stores it).
Usage: json_lines.py FILE"""
import json
import sys


def utf8_hex(s):
    s = "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in s)
    return s.encode("utf-8").hex()


with open(sys.argv[1], encoding="utf-8") as f:
    for line in f:
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            print(f"ERR {e.msg}: column {e.pos + 1} (char {e.pos})")
            continue
        if not isinstance(d, dict):
            print("NOTOBJ")
        elif "text" not in d:
            print("OK missing")
        elif isinstance(d["text"], str):
            print("OK str:" + utf8_hex(d["text"]))
        elif isinstance(d["text"], list) and all(isinstance(x, str) for x in d["text"]):
            print("OK list:" + ",".join(utf8_hex(x) for x in d["text"]))
        else:
            print("OK other")
