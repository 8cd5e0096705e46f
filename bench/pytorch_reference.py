#!/usr/bin/env python3
"""PyTorch + torch.compile reference for megatrain's benchmark configs (bench/configs.sh).

The comparison point named by the project: PyTorch 2.11, torch.compile, SDPA flash attention,
fused AdamW, bf16 autocast over fp32 master weights (Megatron's mixed precision), on random tokens.
Prints one line per config: tokens/s, TFLOP/s by Megatron's formula, peak memory.
Test/benchmark oracle only: megatrain itself never needs Python.
"""
import argparse
import ctypes
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIGS = {
    # name: layers, hidden, heads, groups, ffn, seq, micro_batch, vocab, llama-style
    "gpt2-124m": dict(L=12, h=768, n=12, g=12, f=3072, s=1024, b=32, V=50304, llama=False),
    "gpt-1.3b": dict(L=24, h=2048, n=16, g=16, f=8192, s=2048, b=8, V=50304, llama=False),
    "llama-1b": dict(L=16, h=2048, n=32, g=8, f=8192, s=4096, b=2, V=128256, llama=True),
    # llama-1b's model at long sequences, micro-batch 1 (bench/run_bench.sh's llama-1b-8k/32k/64k)
    "llama-1b-8k": dict(L=16, h=2048, n=32, g=8, f=8192, s=8192, b=1, V=128256, llama=True),
    "llama-1b-32k": dict(L=16, h=2048, n=32, g=8, f=8192, s=32768, b=1, V=128256, llama=True),
    "llama-1b-64k": dict(L=16, h=2048, n=32, g=8, f=8192, s=65536, b=1, V=128256, llama=True),
}


def megatron_flops_per_iteration(c, batch):
    """Megatron-LM HEAD num_floating_point_operations (causal attention halved)."""
    d = c["h"] // c["n"]
    q, k = c["n"] * d, c["g"] * d
    gate = q if c.get("output_gate") else 0  # --attention-output-gate: the gate's rows of the QKV projection
    F_ = 3 if c["llama"] else 2
    per_token = (6 * F_ * c["h"] * c["f"] * c["L"] + 6 * c["L"] * (c["h"] * (q + gate + 2 * k) + q * c["h"])
                 + 6 * c["h"] * c["V"])
    return batch * c["s"] * per_token + batch * c["s"] ** 2 * 6 * q * c["L"]


class RMSNorm(nn.Module):
    def __init__(self, h, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(s, d, base=10000.0, device="cuda"):
    inv = 1.0 / (base ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    t = torch.arange(s, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    return torch.cos(freqs), torch.sin(freqs)


def apply_rope(x, cos, sin):  # x [b, heads, s, d], rotate-half (Megatron's default)
    d2 = x.shape[-1] // 2
    x1, x2 = x[..., :d2], x[..., d2:]
    c, s_ = cos[None, None], sin[None, None]
    return torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], dim=-1)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        h, n, g = c["h"], c["n"], c["g"]
        d = h // n
        bias = not c["llama"]
        Norm = RMSNorm if c["llama"] else nn.LayerNorm
        self.ln1 = Norm(h)
        self.gate = bool(c.get("output_gate"))  # Megatron's --attention-output-gate: sigmoid(g) * attention
        self.qkv = nn.Linear(h, ((2 if self.gate else 1) * n + 2 * g) * d, bias=bias)
        self.proj = nn.Linear(n * d, h, bias=bias)
        self.ln2 = Norm(h)
        self.fc1 = nn.Linear(h, 2 * c["f"] if c["llama"] else c["f"], bias=bias)
        self.fc2 = nn.Linear(c["f"], h, bias=bias)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        n, g = self.c["n"], self.c["g"]
        d = h // n
        qkv = self.qkv(self.ln1(x))
        if self.gate:
            q, gate, k, v = qkv.split([n * d, n * d, g * d, g * d], dim=-1)
        else:
            q, k, v = qkv.split([n * d, g * d, g * d], dim=-1)
        q = q.view(b, s, n, d).transpose(1, 2)
        k = k.view(b, s, g, d).transpose(1, 2)
        v = v.view(b, s, g, d).transpose(1, 2)
        if self.c["llama"]:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.c.get("attention_dropout", 0.0),
                                           is_causal=True, enable_gqa=(g != n))
        y = y.transpose(1, 2).reshape(b, s, n * d)
        if self.gate:
            y = y * torch.sigmoid(gate)
        x = x + self.proj(y)
        z = self.fc1(self.ln2(x))
        if self.c["llama"]:
            gate, up = z.chunk(2, dim=-1)
            z = F.silu(gate) * up
        else:
            z = F.gelu(z, approximate="tanh")  # Megatron's default fused bias-GeLU (bias_gelu_impl) is the tanh form
        return x + self.fc2(z)


class Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.wte = nn.Embedding(c["V"], c["h"])
        self.wpe = None if c["llama"] else nn.Embedding(c["s"], c["h"])
        self.blocks = nn.ModuleList(Block(c) for _ in range(c["L"]))
        self.ln_f = RMSNorm(c["h"]) if c["llama"] else nn.LayerNorm(c["h"])
        self.lm_head = nn.Linear(c["h"], c["V"], bias=False)
        if not c["llama"]:
            self.lm_head.weight = self.wte.weight
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        cos, sin = rope_tables(c["s"], c["h"] // c["n"])
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx, targets):
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def print_kernel_profile(name, step, steps, top):
    """Kernels of `steps` steps under torch.profiler, summed by name: GPU ms per step, calls per step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        r = rows.setdefault(e.name, [0.0, 0])
        r[0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        r[1] += 1
    total = sum(r[0] for r in rows.values())
    print(f"# {name}: PyTorch kernels, GPU ms per step (sum {total / steps / 1e3:.2f} ms), top {top}", flush=True)
    for k, (us, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"#   {us / steps / 1e3:8.3f} ms  {n / steps:6.1f}x  {k[:150]}", flush=True)


def gpu_energy_reader():
    """A function returning the current GPU's energy counter in joules (NVML's
    nvmlDeviceGetTotalEnergyConsumption, the counter megatrain's --log-energy reads), or None
    where NVML is not there. ctypes, so that no pynvml is needed."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        bus_id = f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0".encode()
        handle = ctypes.c_void_p()
        if nvml.nvmlDeviceGetHandleByPciBusId_v2(bus_id, ctypes.byref(handle)) != 0:
            return None
        mj = ctypes.c_ulonglong()

        def joules():
            nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(mj))
            return mj.value / 1000.0

        joules()
        return joules
    except (OSError, AttributeError):
        return None


def timed_result(name, c, step, iters, warmup, flops):
    """warmup steps, then iters timed ones: the result line's fields (tokens/s, TFLOP/s from flops per
    iteration, ms, peak memory, the last loss, and the GPU's energy where NVML reads it)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    energy = gpu_energy_reader()
    e0 = energy() if energy else None
    t0 = time.perf_counter()
    for _ in range(iters):
        loss = step()
    loss.item()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / iters
    joules = (energy() - e0) / iters if energy else None
    tokens = c["b"] * c["s"]
    result = dict(config=name, framework="pytorch-" + torch.__version__, tokens_per_s=tokens / dt,
                  tflops=flops / dt / 1e12, ms_per_iter=dt * 1e3,
                  peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30,
                  # what its caching allocator held at most (megatrain's figure is the device memory
                  # in use above the CUDA context: its arena, workspaces and libraries)
                  peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30, loss=float(loss),
                  attention_dropout=c.get("attention_dropout", 0.0))
    if joules is not None:  # as megatrain's summary: J per iteration, watts, J per token
        result.update(gpu_joules_per_iter=joules, gpu_watts=joules / dt, gpu_joules_per_token=joules / tokens)
    return result


def run(name, iters, warmup, profile_top=0):
    c = CONFIGS[name]
    torch.manual_seed(1234)
    model = Model(c).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step_model = torch.compile(model)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def step():
        idx = torch.randint(0, c["V"], (c["b"], c["s"]), device="cuda", generator=gen)
        tgt = torch.randint(0, c["V"], (c["b"], c["s"]), device="cuda", generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_model(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    result = timed_result(name, c, step, iters, warmup, megatron_flops_per_iteration(c, c["b"]))
    if profile_top:
        print_kernel_profile(name, step, 3, profile_top)
    del model, opt, step_model
    torch.cuda.empty_cache()
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--attention-dropout", type=float, default=0.0,
                    help="SDPA's dropout_p in training (Megatron's --attention-dropout)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--attention-output-gate", action="store_true",
                    help="Megatron's --attention-output-gate: the attention output times sigmoid of a gate the "
                         "QKV projection also makes (one per query element)")
    ap.add_argument("--profile-kernels", type=int, default=0, metavar="N",
                    help="after timing, print the N kernels taking the most GPU time per step (torch.profiler)")
    a = ap.parse_args()
    for name in a.configs.split(","):
        CONFIGS[name]["attention_dropout"] = a.attention_dropout
        CONFIGS[name]["output_gate"] = a.attention_output_gate
        result = run(name, a.iters, a.warmup, a.profile_kernels)
        print(json.dumps(result), flush=True)
