#!/usr/bin/env python3
"""Per-iteration 'lm loss' and 'grad norm' of Megatron-style logs, side by side.

  compare_losses.py [--after N] REFERENCE.log OTHER.log [OTHER.log ...]

Prints one row per iteration (those after N only with --after N: a resumed run's) and, for each
other log, the largest relative difference of the loss and of the gradient norm from the
reference's. Exits 1 when a log lacks an iteration the reference has. (Standard library only.)

With --after N the reference is a straight run and the others resumed at N: a resumed run
(Megatron-LM's, and megatrain's as it follows it) prints at iteration N + 2 the mean of iterations
N + 1 and N + 2, so that iteration's loss is compared with the reference's mean of the two.
"""
import re
import sys

LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+) \|.*?grad norm: ([0-9.]+)")


def read(path):
    rows = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.search(line)
            if m:
                rows[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
    return rows


def main():
    argv = sys.argv[1:]
    after = 0
    if argv[:1] == ["--after"]:
        after, argv = int(argv[1]), argv[2:]
    if len(argv) < 2:
        sys.exit(__doc__)
    sys.argv = [sys.argv[0]] + argv
    ref = {it: v for it, v in read(argv[0]).items() if it > after}
    others = [read(p) for p in argv[1:]]
    if not ref or any(it not in o for o in others for it in ref):
        print("a log lacks iterations the reference has:", [len(ref)] + [len(o) for o in others])
        sys.exit(1)
    print("iteration  " + "  ".join(["reference loss / grad norm"] + [f"log {i + 1} loss / grad norm"
                                                                    for i in range(len(others))]))
    worst = [[0.0, 0.0] for _ in others]
    for it in sorted(ref):
        cells = [f"{ref[it][0]:.6f} / {ref[it][1]:.4f}"]
        want = ref[it][0]
        if after and it == after + 2 and after + 1 in ref:
            want = (ref[after + 1][0] + ref[it][0]) / 2
            cells[0] += f" (mean {want:.7f})"
        for i, o in enumerate(others):
            loss, norm = o[it]
            worst[i][0] = max(worst[i][0], abs(loss - want) / abs(want))
            worst[i][1] = max(worst[i][1], abs(norm - ref[it][1]) / max(abs(ref[it][1]), 1e-12))
            cells.append(f"{loss:.6f} / {norm:.4f}")
        print(f"{it:9d}  " + "  ".join(cells))
    for i, (l, g) in enumerate(worst):
        print(f"log {i + 1} ({sys.argv[2 + i]}): max relative difference: loss {l:.2e}, grad norm {g:.2e} "
              f"over {len(ref)} iterations")


if __name__ == "__main__":
    main()
