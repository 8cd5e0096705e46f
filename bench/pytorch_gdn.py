#!/usr/bin/env python3
"""PyTorch reference for megatrain's Gated DeltaNet hybrid benchmark config (gdn-hybrid).

The model is built from transformers' Qwen3-Next modules (transformers.models.qwen3_next:
Qwen3NextConfig, Qwen3NextModel and its Qwen3NextDecoderLayer / Qwen3NextGatedDeltaNet /
Qwen3NextAttention / Qwen3NextMLP), set to megatrain's flags of gdn-hybrid in bench/run_bench.sh:
  - llama-1b's shape: 16 layers, hidden 2048, vocabulary 128256, untied output layer, no biases,
    RMSNorm (Qwen3-Next's (1 + w) form; eps 1e-5, Megatron's default), seq 4096, micro-batch 2;
  - layer_types: "full_attention" in every 4th layer (3, 7, 11, 15), "linear_attention" in the
    others (--linear-attention-freq 4);
  - softmax layers: 32 heads of 64, 8 KV heads, RoPE over the whole head (partial_rotary_factor
    1.0, theta 10000), q/k RMSNorm per head (--qk-layernorm) and Qwen3-Next's output gate,
    sigmoid(second half of q_proj) per element (--attention-output-gate); SDPA (flash);
  - Gated DeltaNet layers: 16 key heads and 32 value heads of 128, a 4-tap causal convolution;
  - every MLP dense SwiGLU of 8192 (mlp_only_layers = every layer: no MoE block).
The layers run from the model's modules with no attention mask (decoder_forward). Without
flash-linear-attention (fla) and causal-conv1d, Qwen3NextGatedDeltaNet runs transformers'
torch fallbacks: torch_chunk_gated_delta_rule (chunks of 64 positions: each chunk's triangular
system solved by torch.linalg.solve_triangular in newer transformers, by a Python loop over its
rows in older ones; then a Python loop over the chunks), a depthwise torch conv1d + SiLU for the
convolution, and Qwen3NextRMSNormGated. That is the baseline; the JSON line names the paths that
ran (gdn_delta_rule, gdn_conv, gdn_norm). Under bf16 autocast the fallback's matmuls run in bf16
although it casts its inputs to float32.

Conventions of bench/pytorch_reference.py (its timing, energy and kernel-profile helpers are
imported): bf16 autocast over fp32 master weights, fused AdamW, gradient clipping at 1.0, random
tokens; one JSON line per config, last on stdout: tokens/s, TFLOP/s by Megatron's formula for a
Gated DeltaNet hybrid (the terms of megatrain's engine/flops.cpp), MFU against 989 TFLOP/s (as
megatrain's summary line), peak memory, GPU energy.

torch.compile: --compile layers (default) compiles each decoder layer and the output layer with
the loss on their own (the chunk loops of one Gated DeltaNet layer are unrolled once, not twelve
times in one graph); --compile model compiles the whole model as bench/pytorch_reference.py does;
--compile none runs eager. Compilation happens in a first step before the warm-up; if it fails the
run continues eager, and the JSON line's "compile" field says so.
--self-check checks the model's structure, parameter count and FLOP terms on small shapes,
decoder_forward against the model's own forward, and the delta rule the model runs against a
per-position float64 recurrence (megatrain's), then exits.
Test/benchmark oracle only: megatrain itself never needs Python.
"""
import argparse
import importlib.util
import json
import math
import os
import sys
import time

import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_reference import print_kernel_profile, timed_result  # noqa: E402

CONFIGS = {
    # name: layers, hidden, heads, query groups, ffn, seq, micro_batch, vocab; every freq-th layer
    # softmax attention; Gated DeltaNet key / value heads, key / value head dims, convolution taps
    "gdn-hybrid": dict(L=16, h=2048, n=32, g=8, f=8192, s=4096, b=2, V=128256, freq=4,
                       kh=16, vh=32, dk=128, dv=128, conv=4),
}
PEAK_TFLOPS = 989.0  # dense bf16 of an H100 / H200 SXM: megatrain's MFU reference


def softmax_layers(c):
    """Indices of the layers keeping softmax attention (megatrain: layer l if (l + 1) % freq == 0)."""
    return [i for i in range(c["L"]) if (i + 1) % c["freq"] == 0]


def flop_terms(c):
    """Megatron's per-token terms (FLOPs for forward and backward, 6 per weight), as megatrain's
    engine/flops.cpp: the MLP per layer, a softmax layer's projections (the output gate adds q rows
    to the QKV projection), a Gated DeltaNet layer (input projection of q, k, v, z, beta, alpha;
    the convolution; the delta rule, 4 dv^2 per value head; the output projection) and the logits;
    plus the causal attention term per softmax layer, times s^2 per sample."""
    h, d = c["h"], c["h"] // c["n"]
    q, k = c["n"] * d, c["g"] * d
    qk, v = c["kh"] * c["dk"], c["vh"] * c["dv"]
    return dict(
        mlp=6 * h * c["f"] * 3,
        softmax_projections=6 * (h * (q + 2 * k + q) + q * h),
        gdn=6 * (h * (2 * qk + 2 * v + 2 * c["vh"]) + c["conv"] * (2 * qk + v) + c["vh"] * c["dv"] ** 2 * 4 + h * v),
        logits=6 * h * c["V"],
        attention_s2=6 * q,
    )


def megatron_flops_per_iteration(c, batch):
    t = flop_terms(c)
    n_softmax = len(softmax_layers(c))
    n_gdn = c["L"] - n_softmax
    per_token = (t["mlp"] * c["L"] + t["softmax_projections"] * n_softmax + t["gdn"] * n_gdn + t["logits"])
    return batch * c["s"] * per_token + batch * c["s"] ** 2 * t["attention_s2"] * n_softmax


def expected_parameters(c):
    """Parameters of the model below, from its definition: per layer two norms and the SwiGLU MLP;
    softmax layers q (with gate), k, v, o projections and the q/k norms; Gated DeltaNet layers the
    projections, convolution, A_log, dt_bias and the output norm; embeddings, final norm, output layer."""
    h, d = c["h"], c["h"] // c["n"]
    q, k = c["n"] * d, c["g"] * d
    qk, v = c["kh"] * c["dk"], c["vh"] * c["dv"]
    layer = 2 * h + 3 * h * c["f"]
    softmax = h * 2 * q + 2 * h * k + q * h + 2 * d
    gdn = h * (2 * qk + 2 * v) + h * 2 * c["vh"] + (2 * qk + v) * c["conv"] + 2 * c["vh"] + c["dv"] + v * h
    n_softmax = len(softmax_layers(c))
    return 2 * c["V"] * h + h + c["L"] * layer + n_softmax * softmax + (c["L"] - n_softmax) * gdn


def qwen3_next_config(c, attention_dropout=0.0):
    """Qwen3NextConfig for config c. RoPE over the whole head: rope_parameters (newer transformers)
    and rope_theta / partial_rotary_factor (older ones), then checked on the built model."""
    from transformers.models.qwen3_next import Qwen3NextConfig

    layer_types = ["full_attention" if i in softmax_layers(c) else "linear_attention" for i in range(c["L"])]
    base = dict(vocab_size=c["V"], hidden_size=c["h"], intermediate_size=c["f"], num_hidden_layers=c["L"],
                num_attention_heads=c["n"], num_key_value_heads=c["g"], head_dim=c["h"] // c["n"],
                hidden_act="silu", max_position_embeddings=c["s"], initializer_range=0.02, rms_norm_eps=1e-5,
                use_cache=False, tie_word_embeddings=False, attention_bias=False,
                attention_dropout=attention_dropout, linear_conv_kernel_dim=c["conv"],
                linear_key_head_dim=c["dk"], linear_value_head_dim=c["dv"], linear_num_key_heads=c["kh"],
                linear_num_value_heads=c["vh"], decoder_sparse_step=1, mlp_only_layers=list(range(c["L"])),
                layer_types=layer_types, attn_implementation="sdpa",
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0})
    try:
        cfg = Qwen3NextConfig(**base, rope_theta=10000.0, partial_rotary_factor=1.0)
    except (TypeError, ValueError):  # a config class that refuses the older keys
        cfg = Qwen3NextConfig(**base)
    if isinstance(getattr(cfg, "rope_parameters", None), dict):
        cfg.rope_parameters["partial_rotary_factor"] = 1.0
    if hasattr(cfg, "partial_rotary_factor"):
        try:
            cfg.partial_rotary_factor = 1.0
        except (TypeError, ValueError, AttributeError):
            pass
    return cfg


class Head(nn.Module):
    """The output layer and the loss (fp32 cross-entropy over the logits, as the other scripts)."""

    def __init__(self, h, V):
        super().__init__()
        self.lm_head = nn.Linear(h, V, bias=False)

    def forward(self, x, targets):
        logits = self.lm_head(x)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


class Net(nn.Module):
    def __init__(self, c, attention_dropout=0.0):
        super().__init__()
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextModel

        self.model = Qwen3NextModel(qwen3_next_config(c, attention_dropout))
        self.head = Head(c["h"], c["V"])
        nn.init.normal_(self.head.lm_head.weight, std=0.02)

    def forward(self, idx, targets):
        return self.head(decoder_forward(self.model, idx), targets)


def decoder_forward(model, idx):
    """Qwen3NextModel's forward for training on whole sequences (no padding, no cache), without its
    mask construction: its embedding, rotary embedding, decoder layers (attention_mask None: SDPA's
    is_causal, and no mask for the Gated DeltaNet layers) and final norm. transformers' own forward
    builds an explicit causal mask in some versions (4.57 always, 5.x under torch.compile: its
    packed-sequence detection), which keeps SDPA off its flash kernel."""
    x = model.embed_tokens(idx)
    position_ids = torch.arange(idx.shape[1], device=idx.device)[None]
    position_embeddings = model.rotary_emb(x, position_ids)
    for layer in model.layers:
        x = layer(x, position_embeddings=position_embeddings, attention_mask=None, position_ids=position_ids)
    return model.norm(x)


def check_structure(net, c):
    """The built model is config c: layer kinds, dense MLPs, the attention gate, RoPE width,
    Gated DeltaNet widths and the parameter count. Returns a list of problems (empty: ok)."""
    problems = []
    d = c["h"] // c["n"]
    qk, v = c["kh"] * c["dk"], c["vh"] * c["dv"]
    for i, layer in enumerate(net.model.layers):
        want = "full_attention" if i in softmax_layers(c) else "linear_attention"
        has = "full_attention" if hasattr(layer, "self_attn") else "linear_attention" if hasattr(layer, "linear_attn") \
            else type(layer).__name__
        if has != want:
            problems.append(f"layer {i}: {has}, expected {want}")
        mlp = layer.mlp
        if not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")) or \
                mlp.gate_proj.out_features != c["f"] or mlp.down_proj.in_features != c["f"]:
            problems.append(f"layer {i}: MLP is {type(mlp).__name__}, expected a dense SwiGLU of {c['f']}")
        if want == "full_attention":
            attn = getattr(layer, "self_attn", None)
            if attn is None or attn.q_proj.out_features != 2 * c["n"] * d:
                problems.append(f"layer {i}: no output gate in q_proj (expected {2 * c['n'] * d} rows)")
        else:
            gdn = getattr(layer, "linear_attn", None)
            if gdn is None or gdn.conv1d.weight.shape[0] != 2 * qk + v or gdn.out_proj.in_features != v:
                problems.append(f"layer {i}: Gated DeltaNet widths differ from conv {2 * qk + v}, value {v}")
    inv_freq = getattr(net.model.rotary_emb, "inv_freq", None)
    if inv_freq is not None and inv_freq.numel() != d // 2:
        problems.append(f"RoPE turns {2 * inv_freq.numel()} of {d} head dims (partial_rotary_factor not 1.0)")
    n_params = sum(p.numel() for p in net.parameters())
    if n_params != expected_parameters(c):
        problems.append(f"{n_params} parameters, expected {expected_parameters(c)}")
    return problems


def first_gdn(net):
    return next(layer.linear_attn for layer in net.model.layers if hasattr(layer, "linear_attn"))


def delta_rule(gdn):
    """The chunked delta rule a Gated DeltaNet layer calls: the layer's attribute in older
    transformers (fla's or the torch one, chosen at construction), else the module's function (which
    itself picks fla when installed and the inputs are on a GPU)."""
    from transformers.models.qwen3_next import modeling_qwen3_next

    return getattr(gdn, "chunk_gated_delta_rule", None) or modeling_qwen3_next.torch_chunk_gated_delta_rule


def gdn_paths(net):
    """Which delta rule, convolution and gated norm the Gated DeltaNet layers run: older transformers
    keep the chosen functions on the layer; newer ones choose per call (the installed package on a
    GPU, else torch), so there the installed packages say it."""
    gdn = first_gdn(net)
    fla = importlib.util.find_spec("fla") is not None
    conv_pkg = importlib.util.find_spec("causal_conv1d") is not None
    name = lambda f: f"{getattr(f, '__module__', '?')}.{getattr(f, '__name__', type(f).__name__)}"  # noqa: E731
    rule = getattr(gdn, "chunk_gated_delta_rule", None)
    if rule is not None:
        rule = name(rule)
    else:
        rule = "fla chunk_gated_delta_rule" if fla else "torch_chunk_gated_delta_rule"
    if hasattr(gdn, "causal_conv1d_fn"):
        conv = name(gdn.causal_conv1d_fn) if gdn.causal_conv1d_fn is not None else "torch nn.Conv1d + SiLU"
    else:
        conv = "causal_conv1d" if conv_pkg else "torch F.conv1d + SiLU"
    return dict(gdn_delta_rule=rule, gdn_conv=conv, gdn_norm=type(gdn.norm).__name__)


def set_compile(net, mode):
    """The callable running net under torch.compile mode (model, layers or none)."""
    if mode == "model":
        return torch.compile(net)
    if mode == "layers":
        for m in list(net.model.layers) + [net.head]:
            m.compile()
    return net


def unset_compile(net):
    for m in list(net.model.layers) + [net.head]:
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None


def run(name, iters, warmup, compile_mode="layers", profile_top=0):
    c = CONFIGS[name]
    import transformers

    torch.manual_seed(1234)
    with torch.device("cuda"):
        net = Net(c, c.get("attention_dropout", 0.0))
    net.train()
    problems = check_structure(net, c)
    if problems:
        raise RuntimeError("the transformers model is not the config: " + "; ".join(problems))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    for key in ("recompile_limit", "cache_size_limit"):  # 16 layers compiled one by one (--compile layers)
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, max(64, getattr(torch._dynamo.config, key)))
    fwd = [set_compile(net, compile_mode) if compile_mode != "none" else net]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def step():
        idx = torch.randint(0, c["V"], (c["b"], c["s"]), device="cuda", generator=gen)
        tgt = torch.randint(0, c["V"], (c["b"], c["s"]), device="cuda", generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd[0](idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    compiled, compile_s = compile_mode if compile_mode != "none" else "eager", 0.0
    if compile_mode != "none":  # the first step compiles: eager if it fails
        t0 = time.perf_counter()
        try:
            step()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 (any compiler error)
            print(f"# {name}: torch.compile ({compile_mode}) failed, running eager: "
                  f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr, flush=True)
            opt.zero_grad(set_to_none=True)
            unset_compile(net)
            fwd[0] = net
            torch._dynamo.reset()
            torch.cuda.empty_cache()
            compiled = f"eager (torch.compile {compile_mode} failed: {type(exc).__name__})"
        compile_s = time.perf_counter() - t0

    flops = megatron_flops_per_iteration(c, c["b"])
    result = timed_result(name, c, step, iters, warmup, flops)
    result.update(mfu_pct=result["tflops"] / PEAK_TFLOPS * 100.0, flops_per_iter=flops, compile=compiled,
                  first_step_s=compile_s, params=sum(p.numel() for p in net.parameters()),
                  transformers=transformers.__version__,
                  attn_implementation=getattr(net.model.config, "_attn_implementation", None), **gdn_paths(net))
    if profile_top:
        print_kernel_profile(name, step, 3, profile_top)
    del net, opt, fwd
    torch.cuda.empty_cache()
    return result


def reference_delta_rule(q, k, v, g, beta):
    """The gated delta rule per position in float64, as megatrain states it: q, k L2-normalized;
    S = a S + k (beta (v - a S^T k))^T with a = exp(g); output S^T q / sqrt(dk).
    q, k [B, T, H, dk], v [B, T, H, dv], g, beta [B, T, H] -> [B, T, H, dv]."""
    q, k, v, g, beta = (x.double().cpu() for x in (q, k, v, g, beta))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    B, T, H, dk = k.shape
    S = torch.zeros(B, H, dk, v.shape[-1], dtype=torch.float64)
    out = torch.empty(B, T, H, v.shape[-1], dtype=torch.float64)
    for t in range(T):
        a = g[:, t].exp()[..., None, None]
        kt = k[:, t]
        u = beta[:, t][..., None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", a * S, kt))
        S = a * S + kt[..., :, None] * u[..., None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, t]) / math.sqrt(dk)
    return out


def self_check(device):
    """Small shapes, float32: the model's structure and parameter count, the FLOP terms against
    the layers' weights (6 per weight), decoder_forward against the model's own forward, a forward
    and backward with every parameter's gradient, and the delta rule the model runs against
    reference_delta_rule (seq not a multiple of 64)."""
    ok = True
    c = dict(L=4, h=64, n=4, g=2, f=96, s=40, b=2, V=97, freq=4, kh=2, vh=4, dk=16, dv=8, conv=4)

    def report(what, passed, detail=""):
        nonlocal ok
        print(f"# self-check {device}: {what}: {'ok' if passed else 'FAILED'}{' (' + detail + ')' if detail else ''}")
        ok &= bool(passed)

    torch.manual_seed(0)
    with torch.device(device):
        net = Net(c)
    problems = check_structure(net, c)
    report("structure and parameter count", not problems, "; ".join(problems))
    t = flop_terms(c)
    layers = net.model.layers
    weights = lambda mod: sum(p.numel() for p in mod.parameters() if p.dim() == 2)  # noqa: E731
    full, lin = layers[softmax_layers(c)[0]], layers[0]
    gdn = first_gdn(net)
    report("FLOP term: MLP = 6 x its weights", t["mlp"] == 6 * weights(lin.mlp))
    report("FLOP term: softmax projections = 6 x q (with gate), k, v, o weights",
           t["softmax_projections"] == 6 * weights(full.self_attn))
    gdn_proj = sum(6 * m.weight.numel() for m in gdn.modules() if isinstance(m, nn.Linear))
    report("FLOP term: Gated DeltaNet = 6 x projections + conv + 4 dv^2 per value head",
           t["gdn"] == gdn_proj + 6 * gdn.conv1d.weight.numel() + 6 * 4 * c["vh"] * c["dv"] ** 2)
    report("FLOP term: logits = 6 x output layer", t["logits"] == 6 * net.head.lm_head.weight.numel())
    idx = torch.randint(0, c["V"], (c["b"], c["s"]), device=device)
    with torch.no_grad():
        theirs = net.model(input_ids=idx, use_cache=False)[0]
        err = float((decoder_forward(net.model, idx) - theirs).norm() / theirs.norm())
    report("decoder_forward equals Qwen3NextModel's forward", err < 1e-5, f"relative difference {err:.1e}")
    loss = net(idx, torch.randint(0, c["V"], (c["b"], c["s"]), device=device))
    loss.backward()
    missing = [n for n, p in net.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    report("forward and backward", bool(torch.isfinite(loss)) and not missing,
           f"loss {loss.item():.4f}" + (f"; no or non-finite gradient: {', '.join(missing[:5])}" if missing else ""))
    B, T, H = 2, 100, c["vh"]
    q, k = torch.randn(B, T, H, c["dk"], device=device), torch.randn(B, T, H, c["dk"], device=device)
    v = torch.randn(B, T, H, c["dv"], device=device)
    g = -torch.rand(B, T, H, device=device) * 0.5 - 0.01
    beta = torch.rand(B, T, H, device=device)
    out, _ = delta_rule(gdn)(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                             use_qk_l2norm_in_kernel=True)
    ref = reference_delta_rule(q, k, v, g, beta)
    err = float((out.double().cpu() - ref).norm() / ref.norm())
    report(f"delta rule {gdn_paths(net)['gdn_delta_rule']} against the per-position recurrence", err < 1e-4,
           f"relative error {err:.2e}")
    return ok


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--attention-dropout", type=float, default=0.0,
                    help="attention dropout of the softmax layers in training (Megatron's --attention-dropout)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", choices=("layers", "model", "none"), default="layers",
                    help="torch.compile each decoder layer and the output layer (layers), the whole model (model), "
                         "or nothing (none)")
    ap.add_argument("--profile-kernels", type=int, default=0, metavar="N",
                    help="after timing, print the N kernels taking the most GPU time per step (torch.profiler)")
    ap.add_argument("--self-check", action="store_true",
                    help="check the model, its FLOP terms and its delta rule on small shapes (on the GPU where there "
                         "is one, else the CPU), then exit")
    a = ap.parse_args()
    if a.self_check:
        sys.exit(0 if self_check("cuda" if torch.cuda.is_available() else "cpu") else 1)
    for name in a.configs.split(","):
        if name not in CONFIGS:
            sys.exit(f"--configs: unknown config {name}; the Gated DeltaNet configs are {', '.join(CONFIGS)}")
        CONFIGS[name]["attention_dropout"] = a.attention_dropout
        try:
            result = run(name, a.iters, a.warmup, a.compile, a.profile_kernels)
        except Exception as exc:  # noqa: BLE001 (the last stdout line is what bench/run_bench.sh shows)
            print(f"FAILED ({name}): {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
            raise
        print(json.dumps(result), flush=True)
