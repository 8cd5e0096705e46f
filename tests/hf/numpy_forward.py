#!/usr/bin/env python3
"""GPT2LMHeadModel / LlamaForCausalLM (and Mistral, Qwen2 with their sliding windows, Nemotron) forward in numpy (float64), from a Hugging Face directory
(config.json + model.safetensors or its index): the oracle CI checks `megatrain export-hf` against
without torch. Written from the models' definitions (transformers' modeling_gpt2.py and
modeling_llama.py semantics: pre-norm blocks, causal softmax attention scaled by 1/sqrt(d), GPT-2's
Conv1D [in, out] weights, Llama's rotate-half RoPE, RMSNorm, SwiGLU, grouped KV heads).

  numpy_forward.py HF_DIR TOKENS [--compare LOGITS.npy] [--atol A] [--rtol R]

TOKENS is comma-separated ids. Prints the logits' shape and, with --compare, the largest
differences; exits 1 when they exceed the tolerances (|a - b| <= atol + rtol * |b|).
"""
import argparse
import json
import math
import os
import sys

import numpy as np
from safetensors.numpy import load_file


def load_weights(d):
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    w = {}
    for name in files:
        for k, v in load_file(os.path.join(d, name)).items():
            w[k] = v.astype(np.float64)
    return w


def layer_norm(x, g, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def rms_norm(x, g, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g


def causal_attention(q, k, v, window=None):
    """q [T, H, d], k/v [T, G, d] with H a multiple of G (grouped heads share k/v). window: HF's
    sliding_window, the keys a query sees counting itself (key u is kept for query t when
    u > t - window), or None."""
    T, H, d = q.shape
    G = k.shape[1]
    k = np.repeat(k, H // G, axis=1)
    v = np.repeat(v, H // G, axis=1)
    s = np.einsum("thd,uhd->htu", q, k) / math.sqrt(d)
    s = s + np.triu(np.full((T, T), -np.inf), 1)[None]
    if window is not None:
        s = s + np.tril(np.full((T, T), -np.inf), -window)[None]
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("htu,uhd->thd", p, v).reshape(T, H * d)


def gelu(x, kind):
    if kind in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    if kind == "gelu":
        return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    raise SystemExit(f"numpy_forward.py: activation_function {kind} is not implemented")


def gpt2_logits(c, w, tokens):
    pre = "transformer." if "transformer.wte.weight" in w else ""
    E, H = c["n_embd"], c["n_head"]
    eps = c.get("layer_norm_epsilon", 1e-5)
    T = len(tokens)
    x = w[pre + "wte.weight"][tokens] + w[pre + "wpe.weight"][np.arange(T)]
    for i in range(c["n_layer"]):
        p = f"{pre}h.{i}."
        h = layer_norm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"], eps)
        qkv = h @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
        q, k, v = (qkv[:, j * E:(j + 1) * E].reshape(T, H, E // H) for j in range(3))
        x = x + causal_attention(q, k, v) @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        h = layer_norm(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"], eps)
        m = gelu(h @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"], c.get("activation_function", "gelu_new"))
        x = x + m @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    x = layer_norm(x, w[pre + "ln_f.weight"], w[pre + "ln_f.bias"], eps)
    out = w.get("lm_head.weight", w[pre + "wte.weight"])
    return x @ out.T


def llama_inv_freq(c, d):
    theta = c.get("rope_theta", 10000.0)
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    r = c.get("rope_scaling")
    if r:
        kind = r.get("rope_type", r.get("type"))
        if kind != "llama3":
            raise SystemExit(f"numpy_forward.py: rope_scaling {kind} is not implemented")
        factor, lo, hi = r["factor"], r["low_freq_factor"], r["high_freq_factor"]
        old = r["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = np.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def layer_window(c, i):
    """HF's sliding window of layer i, or None: Mistral's on every layer; Qwen2's only with
    use_sliding_window, on layer_types' "sliding_attention" layers or from max_window_layers on."""
    size = c.get("sliding_window")
    if c["model_type"] in ("mistral", "mixtral"):
        return size
    if c["model_type"] == "qwen2" and c.get("use_sliding_window") and size is not None:
        types = c.get("layer_types")
        if types is not None:
            return size if types[i] == "sliding_attention" else None
        return size if i >= c.get("max_window_layers", c["num_hidden_layers"]) else None
    return None


def llama_logits(c, w, tokens):
    """Llama, Mistral, Qwen2; and Nemotron: LayerNorm1P (LayerNorm with weight + 1, and bias), an
    up/down MLP through relu2 (relu(x)^2), RoPE on the first partial_rotary_factor of each head;
    Mixtral: every MLP a mixture of SwiGLU experts (w1 gate, w3 up, w2 down), each token sent to
    the num_experts_per_tok experts of largest softmax(router logits), their weights renormalized."""
    E, H = c["hidden_size"], c["num_attention_heads"]
    G = c.get("num_key_value_heads") or H
    d = c.get("head_dim") or E // H
    nemotron = c["model_type"] == "nemotron"
    eps = c.get("norm_eps", 1e-5) if nemotron else c.get("rms_norm_eps", 1e-6)
    rot = int(d * c.get("partial_rotary_factor", 0.5)) if nemotron else d
    T = len(tokens)
    ang = np.arange(T, dtype=np.float64)[:, None] * llama_inv_freq(c, rot)[None]
    emb = np.concatenate([ang, ang], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)

    def lin(x, name):
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if name + ".bias" in w else y

    def norm(x, name):
        if nemotron:
            return layer_norm(x, w[name + ".weight"] + 1.0, w[name + ".bias"], eps)
        return rms_norm(x, w[name + ".weight"], eps)

    def rope_part(x):
        return np.concatenate([rope(x[..., :rot], cos, sin), x[..., rot:]], axis=-1)

    x = w["model.embed_tokens.weight"][tokens]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, p + "input_layernorm")
        q = rope_part(lin(h, p + "self_attn.q_proj").reshape(T, H, d))
        k = rope_part(lin(h, p + "self_attn.k_proj").reshape(T, G, d))
        v = lin(h, p + "self_attn.v_proj").reshape(T, G, d)
        x = x + lin(causal_attention(q, k, v, layer_window(c, i)), p + "self_attn.o_proj")
        h = norm(x, p + "post_attention_layernorm")
        if c["model_type"] == "mixtral":
            x = x + mixtral_moe(c, h, lambda a, n: lin(a, p + "block_sparse_moe." + n))
        elif nemotron:
            x = x + lin(np.maximum(lin(h, p + "mlp.up_proj"), 0.0) ** 2, p + "mlp.down_proj")
        else:
            gate = lin(h, p + "mlp.gate_proj")
            x = x + lin(gate / (1.0 + np.exp(-gate)) * lin(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    x = norm(x, "model.norm")
    out = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ out.T


def mixtral_moe(c, h, lin):
    E, k = c["num_local_experts"], c["num_experts_per_tok"]
    z = lin(h, "gate")
    s = np.exp(z - z.max(axis=-1, keepdims=True))
    s = s / s.sum(axis=-1, keepdims=True)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        # Top-k by descending score (ties: the lower expert, as torch.topk and megatrain pick).
        chosen = sorted(range(E), key=lambda e: (-s[t, e], e))[:k]
        weights = s[t, chosen] / s[t, chosen].sum()
        for e, wt in zip(chosen, weights):
            gate = lin(h[t:t + 1], f"experts.{e}.w1")
            y = lin(gate / (1.0 + np.exp(-gate)) * lin(h[t:t + 1], f"experts.{e}.w3"), f"experts.{e}.w2")
            out[t] += wt * y[0]
    return out


def logits_of(hf_dir, tokens):
    with open(os.path.join(hf_dir, "config.json")) as f:
        c = json.load(f)
    w = load_weights(hf_dir)
    if c["model_type"] == "gpt2":
        return gpt2_logits(c, w, tokens)
    if c["model_type"] in ("llama", "mistral", "qwen2", "nemotron", "mixtral"):  # (Qwen2: q/k/v biases: lin() adds them)
        return llama_logits(c, w, tokens)
    raise SystemExit(f"numpy_forward.py: model_type {c['model_type']} is not implemented")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_dir")
    ap.add_argument("tokens")
    ap.add_argument("--compare", help=".npy logits to compare with (e.g. megatrain forward-logits)")
    ap.add_argument("--atol", type=float, default=1e-5)
    ap.add_argument("--rtol", type=float, default=1e-4)
    a = ap.parse_args()
    tokens = np.array([int(t) for t in a.tokens.split(",")])
    ref = logits_of(a.hf_dir, tokens)
    print(f"numpy logits {ref.shape}")
    if not a.compare:
        return 0
    got = np.load(a.compare).astype(np.float64)
    if got.shape != ref.shape:
        print(f"FAIL: shapes differ: {got.shape} vs numpy {ref.shape}")
        return 1
    diff = np.abs(got - ref)
    worst = np.unravel_index(np.argmax(diff - a.rtol * np.abs(ref)), diff.shape)
    print(f"max |diff| {diff.max():.3e} (largest |logit| {np.abs(ref).max():.3f}); worst at {worst}: "
          f"{got[worst]:.8f} vs {ref[worst]:.8f}")
    if not np.all(diff <= a.atol + a.rtol * np.abs(ref)):
        print(f"FAIL: logits differ beyond atol {a.atol} + rtol {a.rtol}")
        return 1
    # A check that could pass with constant logits is no check: the logits must vary.
    if np.ptp(ref) < 1e-3:
        print("FAIL: the logits are (nearly) constant; the check would prove nothing")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
