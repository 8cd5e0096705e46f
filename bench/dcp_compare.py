#!/usr/bin/env python3
"""Compares two PyTorch Distributed Checkpoints item by item (needs PyTorch).

    python3 bench/dcp_compare.py DIR_A DIR_B

Each directory is one iteration's torch_dist checkpoint (iter_XXXXXXX). Both are converted with
torch.distributed.checkpoint.format_utils.dcp_to_torch_save and walked as nested dicts and lists:
prints the items only one of them holds, every tensor that differs (shape, dtype or any value, with
the largest difference) and every other value that differs, leaving out Megatron-LM's saved
arguments (common_state/.../args) and RNG states, which name paths and runs. Exit status 1 on any difference.
"""
import os
import sys
import tempfile

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def flatten(x, path=""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from flatten(v, f"{path}/{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from flatten(v, f"{path}[{i}]")
    else:
        yield path, x


def load(d, scratch):
    out = os.path.join(scratch, os.path.basename(os.path.normpath(d)) + f"-{len(os.listdir(scratch))}.pt")
    dcp_to_torch_save(d, out)
    return dict(flatten(torch.load(out, weights_only=False)))


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with tempfile.TemporaryDirectory() as scratch:
        a, b = load(sys.argv[1], scratch), load(sys.argv[2], scratch)
    skip = lambda k: k.endswith("/args") or "/args/" in k or "rng_state" in k
    only_a = sorted(k for k in set(a) - set(b) if not skip(k))
    only_b = sorted(k for k in set(b) - set(a) if not skip(k))
    for k in only_a:
        print(f"only in A: {k}")
    for k in only_b:
        print(f"only in B: {k}")
    differ = 0
    common = sorted(k for k in set(a) & set(b) if not skip(k))
    for k in common:
        x, y = a[k], b[k]
        if torch.is_tensor(x) or torch.is_tensor(y):
            if not (torch.is_tensor(x) and torch.is_tensor(y)) or x.shape != y.shape or x.dtype != y.dtype:
                print(f"DIFF {k}: {getattr(x, 'shape', x)} {getattr(x, 'dtype', '')} vs {getattr(y, 'shape', y)} "
                      f"{getattr(y, 'dtype', '')}")
                differ += 1
            elif not torch.equal(x, y):
                delta = (x.double() - y.double()).abs().max().item()
                print(f"DIFF {k}: max |a - b| {delta:.3e} (max |a| {x.double().abs().max().item():.3e})")
                differ += 1
        elif x != y:
            print(f"DIFF {k}: {x!r:.80} vs {y!r:.80}")
            differ += 1
    print(f"{len(common)} items compared: {differ} differ, {len(only_a)} only in A, {len(only_b)} only in B")
    sys.exit(1 if differ or only_a or only_b else 0)


if __name__ == "__main__":
    main()
