#!/usr/bin/env python3
"""PyTorch + torch.compile reference for megatrain's mixture-of-experts benchmark configs.

The MoE sibling of bench/pytorch_reference.py, with its conventions: PyTorch 2.11, torch.compile of
the model, SDPA flash attention, fused AdamW, bf16 autocast over fp32 master weights, random tokens;
one JSON line per config (tokens/s, TFLOP/s by Megatron's formula, peak memory, GPU energy).

The model is a Llama-style decoder (RMSNorm, RoPE, GQA, untied embeddings, no biases) whose every
MLP is a dropless MoE block as Megatron-Core builds it with --moe-grouped-gemm:
  - router: Linear(h, E, no bias), bf16 logits (no --moe-router-dtype);
  - softmax after the top-k (Megatron's default "post-softmax", no --moe-router-pre-softmax): the k
    largest logits, softmax in fp32 over those k, the weights cast back to the logits' dtype;
  - the (token, expert) pairs sorted expert-major, tokens ascending within an expert (the order of
    Megatron's permutation), so each expert's rows are contiguous;
  - experts: SwiGLU, fc1 weights [E, 2F, h] (rows [gate ; up]) and fc2 weights [E, h, F], each run
    as one grouped GEMM over the sorted rows (torch._grouped_mm, offsets = cumulative token counts
    in int32); the routing weight multiplies the activation before fc2 (in bf16);
  - un-permute: the k expert outputs of a token summed into it by index_add (bf16);
  - load balancing: Switch's aux loss, coeff * E / (k * N^2) * sum_e (sum_t softmax(z)_te) * count_e
    over the N tokens of the micro-batch (= coeff * E * sum_e f_e P_e), added to the loss that is
    back-propagated and, as in Megatron, not to the reported loss (its value / coeff, averaged over
    the layers, is printed as load_balancing_loss).

--experts loop runs the experts one by one (F.linear per expert, outside the compiled graph) in case
the grouped GEMM fails on a machine; --self-check runs the routing and experts on small shapes
against a per-token reference (CPU or GPU) and exits.
Test/benchmark oracle only: megatrain itself never needs Python.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_reference import RMSNorm, apply_rope, print_kernel_profile, rope_tables, timed_result  # noqa: E402

CONFIGS = {
    # name: layers, hidden, heads, groups, experts, top-k, expert ffn, seq, micro_batch, vocab
    "moe-mixtral-proxy": dict(L=16, h=2048, n=32, g=8, E=8, k=2, f=5632, s=4096, b=2, V=32000),
    "moe-fine-grained": dict(L=12, h=2048, n=32, g=8, E=64, k=8, f=768, s=4096, b=2, V=32000),
}
AUX_LOSS_COEFF = 1e-2  # --moe-aux-loss-coeff 1e-2


def megatron_flops_per_iteration(c, batch):
    """Megatron-LM HEAD num_floating_point_operations for a GPT model whose every layer is MoE
    (--moe-layer-freq 1, SwiGLU experts, no shared expert): the MLP term is
    6 * h * F_moe * k * 3 per token per layer (the router GEMM and the dispatch are not counted);
    attention and logits as the dense formula (bench/pytorch_reference.py), causal attention halved."""
    d = c["h"] // c["n"]
    q, kv = c["n"] * d, c["g"] * d
    per_token = (6 * c["h"] * c["f"] * c["k"] * 3 * c["L"] + 6 * c["L"] * (c["h"] * (q + 2 * kv) + q * c["h"])
                 + 6 * c["h"] * c["V"])
    return batch * c["s"] * per_token + batch * c["s"] ** 2 * 6 * q * c["L"]


def grouped_mm_op():
    """torch._grouped_mm (mat_a [rows, K] bf16 sliced into groups by offs, mat_b [groups, K, N],
    offs int32 group ends; out [rows, N]), or its public wrapper torch.nn.functional.grouped_mm
    where a PyTorch has only that."""
    op = getattr(torch, "_grouped_mm", None) or getattr(F, "grouped_mm", None)
    if op is None:
        raise RuntimeError(f"PyTorch {torch.__version__} has no grouped_mm: run with --experts loop")
    return op


def route(logits, k):
    """Softmax after the top-k: indices of the k largest logits, their weights softmax (fp32) over
    those k, cast back to the logits' dtype. logits [T, E] -> (weights [T, k], experts [T, k])."""
    top, idx = torch.topk(logits, k, dim=-1)
    return torch.softmax(top.float(), dim=-1).to(logits.dtype), idx


def switch_aux_loss(logits, counts, k, coeff):
    """Megatron's aux_loss on one micro-batch: coeff * E / (k * N^2) * sum_e P_e * count_e, with P_e
    the sum over the N tokens of softmax(z) over all E (fp32) and count_e the tokens routed to e."""
    n_tokens, n_experts = logits.shape
    p_sum = torch.softmax(logits.float(), dim=-1).sum(0)
    return coeff * n_experts / (k * n_tokens * n_tokens) * (p_sum * counts.float()).sum()


def permutation(idx, n_experts):
    """(token, expert) pairs sorted expert-major, tokens ascending within an expert. Returns the
    order (indices into the flattened [T * k] pairs), each sorted row's token, the tokens per expert
    and the group ends (int32) for the grouped GEMM. Static shapes only (no host sync)."""
    k = idx.shape[1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=idx.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    return order, order // k, counts, offs


def experts_grouped(x, w1, w2, probs, offs):
    """SwiGLU experts as two grouped GEMMs over the expert-sorted rows x [R, h] (bf16 in the
    benchmark). w1 [E, 2F, h], w2 [E, h, F]: fp32 masters cast to x's dtype here (autocast does not
    cover the grouped GEMM), then viewed as [E, h, 2F] / [E, F, h] column-major, the layout the
    grouped GEMM takes for mat_b. probs [R] the rows' routing weights; offs [E] int32 group ends."""
    gmm = grouped_mm_op()
    gate, up = gmm(x, w1.to(x.dtype).transpose(-2, -1), offs=offs).chunk(2, dim=-1)  # [R, 2F]
    return gmm(F.silu(gate) * up * probs[:, None], w2.to(x.dtype).transpose(-2, -1), offs=offs)  # [R, h]


@torch.compiler.disable
def experts_loop(x, w1, w2, probs, counts):
    """The same as experts_grouped, one expert at a time (F.linear); eager, outside the compiled
    graph (the split sizes are read on the host)."""
    sizes = counts.tolist()
    outs = []
    for e, (rows, p) in enumerate(zip(torch.split(x, sizes), torch.split(probs, sizes))):
        gate, up = F.linear(rows, w1[e].to(x.dtype)).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up * p[:, None], w2[e].to(x.dtype)))
    return torch.cat(outs, dim=0)


class MoE(nn.Module):
    def __init__(self, h, n_experts, k, f, coeff=AUX_LOSS_COEFF, experts="grouped"):
        super().__init__()
        self.E, self.k, self.coeff, self.experts = n_experts, k, coeff, experts
        self.router = nn.Linear(h, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(n_experts, 2 * f, h))  # linear_fc1 of each expert, [out, in]
        self.w2 = nn.Parameter(torch.empty(n_experts, h, f))  # linear_fc2 of each expert, [out, in]

    def forward(self, x, dtype=torch.bfloat16):
        """x [T, h] (the pre-MLP norm's output) -> (y [T, h] in dtype, aux loss)."""
        logits = self.router(x)
        probs, idx = route(logits, self.k)
        order, token, counts, offs = permutation(idx, self.E)
        rows = x.to(dtype)[token]
        row_probs = probs.reshape(-1)[order].to(dtype)
        if self.experts == "loop":
            out = experts_loop(rows, self.w1, self.w2, row_probs, counts)
        else:
            out = experts_grouped(rows, self.w1, self.w2, row_probs, offs)
        y = torch.zeros(x.shape, dtype=out.dtype, device=x.device).index_add_(0, token, out)
        return y, switch_aux_loss(logits, counts, self.k, self.coeff)


class Block(nn.Module):
    def __init__(self, c, experts):
        super().__init__()
        self.c = c
        h, n, g = c["h"], c["n"], c["g"]
        d = h // n
        self.ln1 = RMSNorm(h)
        self.qkv = nn.Linear(h, (n + 2 * g) * d, bias=False)
        self.proj = nn.Linear(n * d, h, bias=False)
        self.ln2 = RMSNorm(h)
        self.moe = MoE(h, c["E"], c["k"], c["f"], experts=experts)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        n, g = self.c["n"], self.c["g"]
        d = h // n
        qkv = self.qkv(self.ln1(x))
        q, k, v = qkv.split([n * d, g * d, g * d], dim=-1)
        q = q.view(b, s, n, d).transpose(1, 2)
        k = k.view(b, s, g, d).transpose(1, 2)
        v = v.view(b, s, g, d).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.c.get("attention_dropout", 0.0),
                                           is_causal=True, enable_gqa=(g != n))
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, n * d))
        m, aux = self.moe(self.ln2(x).reshape(b * s, h))
        return x + m.view(b, s, h), aux


class Model(nn.Module):
    def __init__(self, c, experts="grouped"):
        super().__init__()
        self.c = c
        self.wte = nn.Embedding(c["V"], c["h"])
        self.blocks = nn.ModuleList(Block(c, experts) for _ in range(c["L"]))
        self.ln_f = RMSNorm(c["h"])
        self.lm_head = nn.Linear(c["h"], c["V"], bias=False)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
        cos, sin = rope_tables(c["s"], c["h"] // c["n"], device="cpu")  # moved with the model
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx, targets):
        """-> (language-model loss, sum of the layers' aux losses)."""
        x = self.wte(idx)
        aux = x.new_zeros((), dtype=torch.float32)
        for blk in self.blocks:
            x, a = blk(x, self.cos, self.sin)
            aux = aux + a
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1)), aux


def reference_moe(moe, x):
    """Per-token MoE in float64, straight from the definitions (no sorting, no grouped GEMM), on the
    CPU: for each token, the k largest logits, softmax over them, sum_j p_j * fc2(silu(gate) * up);
    the aux loss as coeff * E * sum_e f_e P_e (f_e: fraction of the T * k routed pairs that go to e,
    P_e: mean router softmax). Returns (output, aux loss, gradients of sum(output^2) + aux loss with
    respect to x, the router weight, w1 and w2)."""
    xd = x.detach().cpu().double().requires_grad_(True)
    wr, w1, w2 = (p.detach().cpu().double().requires_grad_(True) for p in (moe.router.weight, moe.w1, moe.w2))
    logits = xd @ wr.t()
    T, E = logits.shape
    rows, counts = [], [0] * E
    for t in range(T):
        values = logits[t].tolist()
        chosen = sorted(range(E), key=lambda e: -values[e])[:moe.k]
        weights = torch.softmax(logits[t, chosen], dim=0)
        row = torch.zeros(xd.shape[1], dtype=torch.float64)
        for e, w in zip(chosen, weights):
            gate, up = (w1[e] @ xd[t]).chunk(2)
            row = row + w2[e] @ (F.silu(gate) * up * w)
            counts[e] += 1
        rows.append(row)
    out = torch.stack(rows)
    f_e = torch.tensor(counts, dtype=torch.float64) / (T * moe.k)
    aux = moe.coeff * E * (f_e * torch.softmax(logits, dim=-1).mean(0)).sum()
    (out.square().sum() + aux).backward()
    return out.detach(), float(aux.detach()), xd.grad, wr.grad, w1.grad, w2.grad


def self_check(device):
    """The MoE block against reference_moe on small shapes with ragged expert loads (token counts
    that are no multiple of 8, an expert with no token): routing bookkeeping, outputs, aux loss and
    all gradients (the aux loss's included), for the loop and the grouped-GEMM experts, in float32
    and bf16 on the CPU, bf16 on a GPU (where the grouped GEMM must run)."""
    ok = True
    rel = lambda a, b: float((a.double().cpu() - b).norm() / b.norm().clamp_min(1e-30))  # noqa: E731
    dtypes = (torch.float32, torch.bfloat16) if device == "cpu" else (torch.bfloat16,)
    for dtype in dtypes:
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # relative to the reference's norm
        for E, k, T, h, f in [(8, 2, 37, 64, 48), (16, 4, 53, 32, 24)]:
            torch.manual_seed(0)
            where = f"E={E} k={k} T={T} {device} {str(dtype).replace('torch.', '')}"
            moe = MoE(h, E, k, f)  # made on the CPU: the same numbers on every device
            for p in moe.parameters():
                nn.init.normal_(p, std=0.1)
            x = torch.randn(T, h)
            x[:, 0] = 5.0
            with torch.no_grad():  # starve the last expert: a constant feature puts its logit far below the others
                moe.router.weight[:, 0] = 0.0
                moe.router.weight[-1, 0] = -50.0
            moe, x = moe.to(device), x.to(device)
            ref, ref_aux, *ref_grads = reference_moe(moe, x)
            with torch.no_grad():  # routing bookkeeping: expert-major, tokens ascending, every pair once
                probs, idx = route(moe.router(x), k)
                order, token, counts, offs = permutation(idx, E)
                sorted_experts = idx.reshape(-1)[order]
                checks = {
                    "weights sum to 1": bool(torch.allclose(probs.float().sum(-1), torch.ones(T, device=device),
                                                            atol=1e-3)),
                    "expert-major": bool((sorted_experts[1:] >= sorted_experts[:-1]).all()),
                    "tokens ascending within an expert": bool(
                        ((sorted_experts[1:] != sorted_experts[:-1]) | (token[1:] > token[:-1])).all()),
                    "every pair once": sorted(order.tolist()) == list(range(T * k)),
                    "offsets": offs.tolist() == torch.cumsum(
                        torch.bincount(idx.reshape(-1).cpu(), minlength=E), 0).tolist(),
                    "an expert has no token": int(counts[-1]) == 0,
                }
            for mode in ("loop", "grouped"):
                moe.experts = mode
                moe.zero_grad(set_to_none=True)
                xm = x.clone().requires_grad_(True)
                try:
                    y, aux = moe(xm, dtype=dtype)
                    (y.float().square().sum() + aux).backward()
                except (RuntimeError, NotImplementedError) as exc:
                    if device == "cpu":  # a PyTorch without a CPU grouped GEMM: the GPU run checks it
                        print(f"# self-check {where}: {mode} experts not run: {str(exc).splitlines()[0]}")
                        continue
                    print(f"# self-check {where}: {mode} experts: {str(exc).splitlines()[0]}")
                    y = None
                checks[f"{mode} experts run"] = y is not None
                if y is None:
                    continue
                checks[f"{mode} output"] = rel(y.detach(), ref) < tol
                checks[f"{mode} aux loss"] = abs(float(aux.detach()) - ref_aux) < 1e-5 * max(1.0, abs(ref_aux))
                grads = (xm.grad, moe.router.weight.grad, moe.w1.grad, moe.w2.grad)
                for name, g, r in zip(("dx", "d router", "d w1", "d w2"), grads, ref_grads):
                    checks[f"{mode} {name}"] = g is not None and rel(g, r) < tol
            for name, passed in checks.items():
                print(f"# self-check {where}: {name}: {'ok' if passed else 'FAILED'}")
                ok &= passed
    return ok


def run(name, iters, warmup, experts, profile_top=0):
    c = CONFIGS[name]
    torch.manual_seed(1234)
    model = Model(c, experts).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step_model = torch.compile(model)
    gen = torch.Generator(device="cuda").manual_seed(0)
    last_aux = [None]

    def step():
        idx = torch.randint(0, c["V"], (c["b"], c["s"]), device="cuda", generator=gen)
        tgt = torch.randint(0, c["V"], (c["b"], c["s"]), device="cuda", generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, aux = step_model(idx, tgt)
        (loss + aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        last_aux[0] = aux.detach()
        return loss

    result = timed_result(name, c, step, iters, warmup, megatron_flops_per_iteration(c, c["b"]))
    result.update(load_balancing_loss=float(last_aux[0]) / AUX_LOSS_COEFF / c["L"],
                  experts="loop" if experts == "loop" else grouped_mm_op().__name__)
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
    ap.add_argument("--experts", choices=("grouped", "loop"), default="grouped",
                    help="grouped: one torch._grouped_mm per expert GEMM (default); loop: one F.linear per expert")
    ap.add_argument("--profile-kernels", type=int, default=0, metavar="N",
                    help="after timing, print the N kernels taking the most GPU time per step (torch.profiler)")
    ap.add_argument("--num-layers", type=int, default=0,
                    help="the decoder layers of every config run (default: the config's own), e.g. 10 for "
                         "moe-mixtral-proxy on an 80 GB GPU (megatrain's side: --extra \"--num-layers 10\")")
    ap.add_argument("--self-check", action="store_true",
                    help="check routing, permutation, experts and aux loss against a per-token reference on small "
                         "shapes (on the GPU where there is one, else the CPU), then exit")
    a = ap.parse_args()
    if a.self_check:
        sys.exit(0 if self_check("cuda" if torch.cuda.is_available() else "cpu") else 1)
    for name in a.configs.split(","):
        if name not in CONFIGS:
            sys.exit(f"--configs: unknown config {name}; the MoE configs are {', '.join(CONFIGS)}")
        CONFIGS[name]["attention_dropout"] = a.attention_dropout
        if a.num_layers > 0:
            CONFIGS[name]["L"] = a.num_layers
        result = run(name, a.iters, a.warmup, a.experts, a.profile_kernels)
        print(json.dumps(result), flush=True)
