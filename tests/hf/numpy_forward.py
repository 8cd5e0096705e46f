#!/usr/bin/env python3
"""GPT2LMHeadModel / LlamaForCausalLM (and Mistral, Qwen2 with their sliding windows, Nemotron, Mixtral,
Qwen3, Qwen3-MoE, Qwen2-MoE) forward in numpy (float64), from a Hugging Face directory
(config.json + model.safetensors or its index): the oracle CI checks `megatrain export-hf` against
without torch. Written from the models' definitions (transformers' modeling_gpt2.py and
modeling_llama.py semantics: pre-norm blocks, causal softmax attention scaled by 1/sqrt(d), GPT-2's
Conv1D [in, out] weights, Llama's rotate-half RoPE, RMSNorm, SwiGLU, grouped KV heads; Qwen3's
per-head q/k RMSNorm before RoPE; the Qwen MoE blocks' softmax top-k routing over per-expert SwiGLUs,
Qwen2-MoE's sigmoid-gated shared expert). Keys a config.json leaves out take transformers' defaults.

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


def rope_parameters(c):
    """transformers 5's reading: rope_scaling (the older name) or else rope_parameters, with rope_theta
    taken from that dict, else from the top level (where transformers 4 reads it), else 10000."""
    r = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if "full_attention" in r or "sliding_attention" in r:
        raise SystemExit("numpy_forward.py: RoPE parameters per layer type are not implemented")
    theta = r.get("rope_theta", c.get("rope_theta", 10000.0))
    if c.get("rope_theta", theta) != theta:
        raise SystemExit("numpy_forward.py: rope_theta differs between the top level and the rope dict")
    return theta, r, r.get("rope_type", r.get("type", "default"))


def llama_inv_freq(c, d):
    theta, r, kind = rope_parameters(c)
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    if kind != "default":
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
    """HF's sliding window of layer i, or None: Mistral's on every layer; Qwen2's and Qwen3's only with
    use_sliding_window, on layer_types' "sliding_attention" layers or from max_window_layers on;
    Qwen3-MoE's with use_sliding_window on every layer (it reads no layer_types / max_window_layers)."""
    size = c.get("sliding_window")
    if c["model_type"] in ("mistral", "mixtral"):
        return size
    if c["model_type"] in ("qwen2", "qwen3") and c.get("use_sliding_window") and size is not None:
        types = c.get("layer_types")
        if types is not None:
            return size if types[i] == "sliding_attention" else None
        return size if i >= c["max_window_layers"] else None
    if c["model_type"] == "qwen3_moe" and c.get("use_sliding_window"):
        return size
    if c["model_type"] == "qwen2_moe" and (c.get("use_sliding_window") or "sliding_attention" in (c.get("layer_types") or [])):
        # transformers 4.57 windows every layer (eager/sdpa) or those from max_window_layers on (flash);
        # 5.x the even layers below max_window_layers: no single semantics to check against.
        raise SystemExit("numpy_forward.py: Qwen2-MoE's sliding window is not implemented")
    return None


def llama_logits(c, w, tokens):
    """Llama, Mistral, Qwen2; and Nemotron: LayerNorm1P (LayerNorm with weight + 1, and bias), an
    up/down MLP through relu2 (relu(x)^2), RoPE on the first partial_rotary_factor of each head;
    Mixtral: every MLP a mixture of SwiGLU experts (w1 gate, w3 up, w2 down), each token sent to
    the num_experts_per_tok experts of largest softmax(router logits), their weights renormalized;
    Qwen3 (and Qwen3-MoE): RMSNorm (q_norm, k_norm) on each head's q and k before RoPE; Qwen3-MoE and
    Qwen2-MoE: the sparse layers' MLP a qwen_moe block, the others (mlp_only_layers, off the
    decoder_sparse_step) a SwiGLU of intermediate_size."""
    E, H = c["hidden_size"], c["num_attention_heads"]
    G = c.get("num_key_value_heads") or H
    d = c.get("head_dim") or E // H
    nemotron = c["model_type"] == "nemotron"
    qk_norm = c["model_type"] in ("qwen3", "qwen3_moe")
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

    def heads(h, name, n):
        y = lin(h, name + "_proj").reshape(T, n, d)
        return rms_norm(y, w[name + "_norm.weight"], eps) if qk_norm else y

    x = w["model.embed_tokens.weight"][tokens]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, p + "input_layernorm")
        q = rope_part(heads(h, p + "self_attn.q", H))
        k = rope_part(heads(h, p + "self_attn.k", G))
        v = lin(h, p + "self_attn.v_proj").reshape(T, G, d)
        x = x + lin(causal_attention(q, k, v, layer_window(c, i)), p + "self_attn.o_proj")
        h = norm(x, p + "post_attention_layernorm")
        if c["model_type"] == "mixtral":
            x = x + mixtral_moe(c, h, lambda a, n: lin(a, p + "block_sparse_moe." + n))
        elif nemotron:
            x = x + lin(np.maximum(lin(h, p + "mlp.up_proj"), 0.0) ** 2, p + "mlp.down_proj")
        elif sparse_layer(c, i):
            x = x + qwen_moe(c, h, lambda a, n: lin(a, p + "mlp." + n))
        else:
            x = x + swiglu(h, lambda a, n: lin(a, p + "mlp." + n))
    x = norm(x, "model.norm")
    out = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ out.T


def swiglu(h, lin, pre=""):
    """Llama's / Qwen's MLP: down_proj(silu(gate_proj(h)) * up_proj(h)), the projections named pre + ..."""
    gate = lin(h, pre + "gate_proj")
    return lin(gate / (1.0 + np.exp(-gate)) * lin(h, pre + "up_proj"), pre + "down_proj")


def route(z, k, renormalize):
    """Router logits z [T, E] -> softmax over all E experts, then each token's k largest (ties: the
    lower expert, as torch.topk and megatrain pick), renormalized to sum 1 when renormalize:
    (chosen experts [T, k], their weights [T, k])."""
    s = np.exp(z - z.max(axis=-1, keepdims=True))
    s = s / s.sum(axis=-1, keepdims=True)
    chosen = np.argsort(-s, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(s, chosen, axis=-1)
    return chosen, (weights / weights.sum(axis=-1, keepdims=True) if renormalize else weights)


def sparse_layer(c, i):
    """Qwen3-MoE's / Qwen2-MoE's rule: layer i is a sparse MoE block unless listed in mlp_only_layers,
    when num_experts > 0 and (i + 1) % decoder_sparse_step == 0."""
    if c["model_type"] not in ("qwen3_moe", "qwen2_moe"):
        return False
    return (i not in (c.get("mlp_only_layers") or []) and c["num_experts"] > 0
            and (i + 1) % c["decoder_sparse_step"] == 0)


def qwen_moe(c, h, lin):
    """Qwen3MoeSparseMoeBlock / Qwen2MoeSparseMoeBlock: route(gate(h)) to num_experts_per_tok of the
    num_experts SwiGLU experts (experts.{e}.gate_proj / up_proj / down_proj), weights renormalized
    when norm_topk_prob; Qwen2-MoE adds sigmoid(shared_expert_gate(h)) * shared_expert(h)."""
    chosen, weights = route(lin(h, "gate"), c["num_experts_per_tok"], c["norm_topk_prob"])
    out = np.zeros_like(h)
    for e in range(c["num_experts"]):
        wt = (weights * (chosen == e)).sum(axis=-1)
        rows = np.flatnonzero((chosen == e).any(axis=-1))
        if rows.size:
            out[rows] += wt[rows, None] * swiglu(h[rows], lin, f"experts.{e}.")
    if c["model_type"] == "qwen2_moe":
        out += swiglu(h, lin, "shared_expert.") / (1.0 + np.exp(-lin(h, "shared_expert_gate")))
    return out


def mixtral_moe(c, h, lin):
    chosen, weights = route(lin(h, "gate"), c["num_experts_per_tok"], True)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        for e, wt in zip(chosen[t], weights[t]):
            gate = lin(h[t:t + 1], f"experts.{e}.w1")
            y = lin(gate / (1.0 + np.exp(-gate)) * lin(h[t:t + 1], f"experts.{e}.w3"), f"experts.{e}.w2")
            out[t] += wt * y[0]
    return out


# transformers' defaults (its configuration_*.py) for the keys read here that a config.json may leave out.
TRANSFORMERS_DEFAULTS = {
    "qwen2": {"num_key_value_heads": 32, "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "sliding_window": 4096, "max_window_layers": 28},
    "qwen3_moe": {"num_key_value_heads": 4, "sliding_window": 4096, "num_experts": 128, "num_experts_per_tok": 8,
                  "norm_topk_prob": False, "decoder_sparse_step": 1},
    "qwen2_moe": {"num_key_value_heads": 16, "sliding_window": 4096, "max_window_layers": 28, "num_experts": 60,
                  "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1},
}


def read_config(hf_dir):
    with open(os.path.join(hf_dir, "config.json")) as f:
        c = json.load(f)
    if c["model_type"] in ("qwen3_moe", "qwen2_moe") and "num_experts" not in c and "num_local_experts" in c:
        c["num_experts"] = c["num_local_experts"]  # (transformers 5 saves Qwen3-MoE's under its attribute_map name)
    return {**TRANSFORMERS_DEFAULTS.get(c["model_type"], {}), **c}


def logits_of(hf_dir, tokens):
    c = read_config(hf_dir)
    w = load_weights(hf_dir)
    if c["model_type"] == "gpt2":
        return gpt2_logits(c, w, tokens)
    # (Qwen2, Qwen2-MoE: q/k/v biases, Qwen3 with attention_bias: q/k/v/o biases: lin() adds them)
    if c["model_type"] in ("llama", "mistral", "qwen2", "nemotron", "mixtral", "qwen3", "qwen3_moe", "qwen2_moe"):
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
