#!/usr/bin/env python3
"""PyTorch SDPA (cuDNN backend) forward and backward at megatrain's three model shapes.

Beside bench_attention: the same causal shapes, in PyTorch's layout ([b, s, heads, d] views of the
packed QKV rows, as bench/pytorch_reference.py's model makes them) and in megatrain's ([s, b, ...]
rows: position-major, Megatron's order). Times: CUDA events, median of --reps calls after
warm-up; backward = torch.autograd.grad of the output, PyTorch's helpers (dO.O, dQ conversion,
GQA head sums) included. FLOPs as bench_attention's: causal forward 2*B*H*T^2*D, backward 2.5x.
Test/benchmark oracle only.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {  # name: batch, heads, groups, seq, head_dim
    "gpt2-124m": (32, 12, 12, 1024, 64),
    "gpt-1.3b": (8, 16, 16, 2048, 128),
    "llama-1b": (2, 32, 8, 4096, 64),
}


def median_ms(fn, reps):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def qkv_views(b, n, g, s, d, position_major):
    """q, k, v as [b, heads, s, d] views of one packed [tokens, (n + 2g) d] bf16 buffer."""
    width = (n + 2 * g) * d
    if position_major:
        rows = torch.randn(s, b, width, device="cuda", dtype=torch.bfloat16).permute(1, 0, 2)
    else:
        rows = torch.randn(b, s, width, device="cuda", dtype=torch.bfloat16)
    q, k, v = rows.split([n * d, g * d, g * d], dim=-1)
    views = [t.unflatten(-1, (-1, d)).transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
    return views


def run(name, reps, position_major):
    b, n, g, s, d = SHAPES[name]
    q, k, v = qkv_views(b, n, g, s, d, position_major)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=(g != n))
        dout = torch.randn_like(out)
        fwd = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=(g != n)), reps)
        bwd = median_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), reps)
    flops = 2.0 * b * n * s * s * d
    layout = "[s, b] rows" if position_major else "[b, s] rows"
    print(f"{name} b{b} s{s} h{n}/{g} d{d} {layout}: forward {fwd:.3f} ms {flops / fwd / 1e9:.0f} TFLOP/s, "
          f"backward {bwd:.3f} ms {2.5 * flops / bwd / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    for name in a.configs.split(","):
        for position_major in (False, True):
            run(name, a.reps, position_major)
