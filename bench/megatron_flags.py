#!/usr/bin/env python3
"""Lists every flag spelling Megatron-LM's pretrain_gpt.py parses, read from a Megatron-LM source tree
without importing it (no PyTorch needed), and which of them megatrain does not know.

The flags come from megatron/training/arguments.py: its add_argument calls, and the flags its
ArgumentGroupFactory generates from configuration dataclasses (a field `foo_bar` is `--foo-bar`, a
bool field whose default is True is `--no-foo-bar` and `--disable-foo-bar`, metadata arg_names
win, excluded fields are left out), plus ModelOpt's (megatron/post_training/arguments.py, parsed
when nvidia-modelopt is installed).

  python3 bench/megatron_flags.py --megatron ~/Megatron-LM --megatrain build/app/megatrain
  python3 bench/megatron_flags.py --megatron ~/Megatron-LM --write-fixture tests/fixtures/megatron_flags.txt

tests/cli_parse_test.cpp checks that megatrain knows every flag of the fixture.
"""
import argparse
import ast
import os
import re
import subprocess
import sys


def literal_flags(tree):
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            for a in node.args:
                if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--"):
                    out.add(a.value)
    return out


def class_index(root):
    classes = {}
    for dirpath, _, files in os.walk(os.path.join(root, "megatron")):
        for name in files:
            if not name.endswith(".py"):
                continue
            try:
                tree = ast.parse(open(os.path.join(dirpath, name), encoding="utf-8").read())
            except (SyntaxError, UnicodeDecodeError):
                continue
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    classes.setdefault(node.name, node)
    return classes


def dataclass_fields(classes, name):
    """(field, annotation, default source, metadata node) of a dataclass and its bases, in order."""
    cls = classes.get(name)
    if cls is None:
        sys.exit(f"class {name} not found")
    fields = []
    for base in cls.bases:
        base_name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
        if base_name in classes:
            fields += dataclass_fields(classes, base_name)
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        field, annotation = node.target.id, ast.unparse(node.annotation)
        if field.startswith("_") or "ClassVar" in annotation:
            continue
        default, metadata, init = None, None, True
        value = node.value
        if isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) == "field":
            for kw in value.keywords:
                if kw.arg == "default":
                    default = ast.unparse(kw.value)
                elif kw.arg == "init":
                    init = ast.unparse(kw.value) != "False"
                elif kw.arg == "metadata":
                    metadata = kw.value
        elif value is not None:
            default = ast.unparse(value)
        if init:
            fields.append((field, annotation, default, metadata))
    return fields


def exclusions(tree, call):
    excluded = set()
    for kw in call.keywords:
        if kw.arg != "exclude":
            continue
        if isinstance(kw.value, ast.Name):  # a list assigned earlier in the file
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == kw.value.id for t in node.targets):
                    excluded |= set(ast.literal_eval(node.value))
        else:
            excluded |= set(ast.literal_eval(kw.value))
    return excluded


def factory_flags(tree, classes):
    out = set()
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and getattr(call.func, "id", "") == "ArgumentGroupFactory"):
            continue
        excluded = exclusions(tree, call)
        for field, annotation, default, metadata in dataclass_fields(classes, ast.unparse(call.args[0])):
            if field in excluded:
                continue
            named = re.findall(r"'(--[a-z0-9_-]+)'", ast.unparse(metadata)) if metadata is not None else []
            if named and "arg_names" in ast.unparse(metadata):
                out |= set(named)
            elif annotation.strip() == "bool" and default == "True":
                out |= {"--no-" + field.replace("_", "-"), "--disable-" + field.replace("_", "-")}
            else:
                out.add("--" + field.replace("_", "-"))
    return out


def megatron_flags(root):
    arguments = os.path.join(root, "megatron", "training", "arguments.py")
    tree = ast.parse(open(arguments, encoding="utf-8").read())
    flags = literal_flags(tree) | factory_flags(tree, class_index(root))
    modelopt = os.path.join(root, "megatron", "post_training", "arguments.py")
    if os.path.exists(modelopt):
        flags |= literal_flags(ast.parse(open(modelopt, encoding="utf-8").read()))
    return sorted(flags)


def megatrain_flags(binary):
    table = subprocess.run([binary, "--list-flags"], capture_output=True, text=True, check=True).stdout
    known = set()
    for line in table.splitlines():
        if line.startswith("| `--"):
            known |= set(re.findall(r"--[a-z0-9_-]+", line.split("|")[1]))
    return known


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron", required=True, help="a Megatron-LM source tree")
    ap.add_argument("--megatrain", help="a megatrain binary: list the flags it does not know")
    ap.add_argument("--write-fixture", help="write the flags here, one per line")
    ap.add_argument("--megatron-commit", help="the tree's commit for the fixture's header (default: git rev-parse)")
    a = ap.parse_args()
    flags = megatron_flags(a.megatron)
    print(f"{len(flags)} flag spellings in Megatron-LM's parser")
    if a.megatrain:
        unknown = [f for f in flags if f not in megatrain_flags(a.megatrain)]
        print(f"{len(unknown)} of them unknown to megatrain" + (":" if unknown else ""))
        for f in unknown:
            print("  " + f)
    if a.write_fixture:
        commit = a.megatron_commit or subprocess.run(["git", "-C", a.megatron, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "unknown"
        with open(a.write_fixture, "w") as fh:
            fh.write(f"# Every flag spelling Megatron-LM's pretrain_gpt.py parses ({len(flags)}, Megatron-LM {commit}),\n"
                     "# written by bench/megatron_flags.py --write-fixture; megatrain must know each.\n")
            fh.write("\n".join(flags) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
