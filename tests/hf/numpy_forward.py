#!/usr/bin/env python3
"""GPT2LMHeadModel / LlamaForCausalLM (and Mistral, Qwen2 with their sliding windows, Nemotron, Mixtral,
Qwen3, Qwen3-MoE, Qwen2-MoE, Qwen3-Next) forward in numpy (float64), from a Hugging Face directory
(config.json + model.safetensors or its index): the oracle CI checks `megatrain export-hf` against
without torch. Written from the models' definitions (transformers' modeling_gpt2.py and
modeling_llama.py semantics: pre-norm blocks, causal softmax attention scaled by 1/sqrt(d), GPT-2's
Conv1D [in, out] weights, Llama's rotate-half RoPE, RMSNorm, SwiGLU, grouped KV heads; Qwen3's
per-head q/k RMSNorm before RoPE; the Qwen MoE blocks' softmax top-k routing over per-expert SwiGLUs,
Qwen2-MoE's sigmoid-gated shared expert; Qwen3-Next's Gated DeltaNet layers, the gated delta rule run
token by token, beside its gated softmax attention). Keys a config.json leaves out take transformers'
defaults.

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
        else:
            x = x + swiglu_or_moe(c, i, h, lambda a, n: lin(a, p + "mlp." + n))
    return output_logits(norm(x, "model.norm"), w)


def swiglu_or_moe(c, i, h, lin):
    """Layer i's MLP: Qwen's sparse MoE block where sparse_layer says, else a SwiGLU."""
    return qwen_moe(c, h, lin) if sparse_layer(c, i) else swiglu(h, lin)


def output_logits(x, w):
    """The final-normed x times lm_head, or the tied embeddings without one."""
    return x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T


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
    """Qwen3-MoE's / Qwen2-MoE's / Qwen3-Next's rule: layer i is a sparse MoE block unless listed in
    mlp_only_layers, when num_experts > 0 and (i + 1) % decoder_sparse_step == 0."""
    if c["model_type"] not in ("qwen3_moe", "qwen2_moe", "qwen3_next"):
        return False
    return (i not in (c.get("mlp_only_layers") or []) and c["num_experts"] > 0
            and (i + 1) % c["decoder_sparse_step"] == 0)


def qwen_moe(c, h, lin):
    """Qwen3MoeSparseMoeBlock / Qwen2MoeSparseMoeBlock / Qwen3NextSparseMoeBlock: route(gate(h)) to
    num_experts_per_tok of the num_experts SwiGLU experts (experts.{e}.gate_proj / up_proj / down_proj,
    the Hub's names: transformers 5 stacks them only once loaded), weights renormalized when
    norm_topk_prob; Qwen2-MoE and Qwen3-Next add sigmoid(shared_expert_gate(h)) * shared_expert(h)."""
    chosen, weights = route(lin(h, "gate"), c["num_experts_per_tok"], c["norm_topk_prob"])
    out = np.zeros_like(h)
    for e in range(c["num_experts"]):
        wt = (weights * (chosen == e)).sum(axis=-1)
        rows = np.flatnonzero((chosen == e).any(axis=-1))
        if rows.size:
            out[rows] += wt[rows, None] * swiglu(h[rows], lin, f"experts.{e}.")
    if c["model_type"] in ("qwen2_moe", "qwen3_next"):
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


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    """torch's F.softplus (beta 1, threshold 20: x itself above 20)."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def qwen3_next_layer_types(c):
    """config.layer_types, or as Qwen3NextConfig derives it: every full_attention_interval-th layer
    (default 4) full attention, the others linear attention."""
    if c.get("layer_types") is not None:
        return c["layer_types"]
    n = c.get("full_attention_interval", 4)
    return ["linear_attention" if (i + 1) % n else "full_attention" for i in range(c["num_hidden_layers"])]


def qwen3_next_rotary_factor(c):
    """transformers 5: partial_rotary_factor from the rope dict, else the top level, else 0.25 (4.57 reads
    the top level alone, defaulting to 0.25 too)."""
    _, r, _ = rope_parameters(c)
    top = c.get("partial_rotary_factor")
    factor = r.get("partial_rotary_factor", 0.25 if top is None else top)
    if top is not None and factor != top:
        raise SystemExit("numpy_forward.py: partial_rotary_factor differs between the top level and the rope dict")
    return factor


def gated_delta_rule(q, k, v, g, beta):
    """The gated delta rule, token by token (transformers' torch_recurrent_gated_delta_rule; its chunked
    form computes the same). q, k [T, H, dk] (normalized, q scaled), v [T, H, dv], g, beta [T, H]; each
    head's state S [dk, dv] starts at 0, then for each t: S = exp(g_t) S, S += k_t (beta_t (v_t - S^T k_t))^T,
    output_t = S^T q_t."""
    T, H, dk = k.shape
    S = np.zeros((H, dk, v.shape[-1]))
    out = np.zeros_like(v)
    for t in range(T):
        S = S * np.exp(g[t])[:, None, None]
        delta = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", S, k[t]))
        S = S + k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", S, q[t])
    return out


def gated_delta_net(c, h, w, p, eps):
    """Qwen3NextGatedDeltaNet on h [T, hidden], its weights named p + ... . in_proj_qkvz's rows come in
    linear_num_key_heads groups, one a key head: [q (dk) | k (dk) | v (r * dv) | z (r * dv)], the v / z
    parts those of the key head's r = num_v_heads / num_k_heads value heads in turn; in_proj_ba's the
    same way, [b (r) | a (r)]. The causal depthwise conv1d (weight [channels, 1, K], no bias, then SiLU)
    runs over the channels [all q heads | all k heads | all v heads]; q and k are then L2-normalized
    (eps 1e-6 under the root), q scaled by dk^-0.5, and each shared by its r value heads in turn;
    beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias). Each value head's output is RMSNormed
    (plain weight, not 1 + weight) times silu(z), then out_proj."""
    T = h.shape[0]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    r = nv // nk
    qkvz = (h @ w[p + "in_proj_qkvz.weight"].T).reshape(T, nk, 2 * dk + 2 * r * dv)
    ba = (h @ w[p + "in_proj_ba.weight"].T).reshape(T, nk, 2 * r)
    z = qkvz[..., 2 * dk + r * dv:].reshape(T, nv, dv)
    b, a = ba[..., :r].reshape(T, nv), ba[..., r:].reshape(T, nv)
    mixed = np.concatenate([qkvz[..., :dk].reshape(T, -1), qkvz[..., dk:2 * dk].reshape(T, -1),
                            qkvz[..., 2 * dk:2 * dk + r * dv].reshape(T, -1)], axis=-1)
    kernel = w[p + "conv1d.weight"][:, 0, :]  # [channels, K]
    K = kernel.shape[1]
    padded = np.concatenate([np.zeros((K - 1, mixed.shape[1])), mixed])
    conv = sum(padded[j:j + T] * kernel[:, j] for j in range(K))
    conv = conv * sigmoid(conv)
    q = conv[:, :nk * dk].reshape(T, nk, dk)
    k = conv[:, nk * dk:2 * nk * dk].reshape(T, nk, dk)
    v = conv[:, 2 * nk * dk:].reshape(T, nv, dv)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / math.sqrt(dk)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    beta = sigmoid(b)
    g = -np.exp(w[p + "A_log"]) * softplus(a + w[p + "dt_bias"])
    o = gated_delta_rule(np.repeat(q, r, axis=1), np.repeat(k, r, axis=1), v, g, beta)
    o = rms_norm(o, w[p + "norm.weight"], eps) * z * sigmoid(z)
    return o.reshape(T, nv * dv) @ w[p + "out_proj.weight"].T


def qwen3_next_logits(c, w, tokens):
    """Qwen3NextForCausalLM: every RMSNorm but the Gated DeltaNet's zero-centred (x / rms * (1 + w));
    layer_types' linear_attention layers a gated_delta_net, the full_attention ones softmax attention
    whose q_proj gives each head [q (head_dim) | gate (head_dim)], q/k norms before RoPE on the first
    partial_rotary_factor of each head, the heads' output times sigmoid(gate) before o_proj; MLPs as
    Qwen2-MoE's (sparse_layer, qwen_moe with its gated shared expert) or a SwiGLU of intermediate_size."""
    if c.get("hidden_act", "silu") != "silu":
        raise SystemExit(f"numpy_forward.py: Qwen3-Next hidden_act {c['hidden_act']} is not implemented")
    E, H, G = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or E // H
    eps = c.get("rms_norm_eps", 1e-6)
    rot = int(d * qwen3_next_rotary_factor(c))
    T = len(tokens)
    ang = np.arange(T, dtype=np.float64)[:, None] * llama_inv_freq(c, rot)[None]
    emb = np.concatenate([ang, ang], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)
    types = qwen3_next_layer_types(c)

    def lin(x, name):
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if name + ".bias" in w else y

    def norm(x, name):
        return rms_norm(x, 1.0 + w[name + ".weight"], eps)

    def rope_part(x):
        return np.concatenate([rope(x[..., :rot], cos, sin), x[..., rot:]], axis=-1)

    x = w["model.embed_tokens.weight"][tokens]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, p + "input_layernorm")
        if types[i] == "linear_attention":
            x = x + gated_delta_net(c, h, w, p + "linear_attn.", eps)
        elif types[i] == "full_attention":
            qg = lin(h, p + "self_attn.q_proj").reshape(T, H, 2 * d)
            q = rope_part(norm(qg[..., :d], p + "self_attn.q_norm"))
            k = rope_part(norm(lin(h, p + "self_attn.k_proj").reshape(T, G, d), p + "self_attn.k_norm"))
            v = lin(h, p + "self_attn.v_proj").reshape(T, G, d)
            o = causal_attention(q, k, v) * sigmoid(qg[..., d:].reshape(T, H * d))
            x = x + lin(o, p + "self_attn.o_proj")
        else:
            raise SystemExit(f"numpy_forward.py: Qwen3-Next layer type {types[i]} is not implemented")
        h = norm(x, p + "post_attention_layernorm")
        x = x + swiglu_or_moe(c, i, h, lambda a, n: lin(a, p + "mlp." + n))
    return output_logits(norm(x, "model.norm"), w)


# transformers' defaults (its configuration_*.py) for the keys read here that a config.json may leave out.
TRANSFORMERS_DEFAULTS = {
    "qwen2": {"num_key_value_heads": 32, "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "sliding_window": 4096, "max_window_layers": 28},
    "qwen3_moe": {"num_key_value_heads": 4, "sliding_window": 4096, "num_experts": 128, "num_experts_per_tok": 8,
                  "norm_topk_prob": False, "decoder_sparse_step": 1},
    "qwen2_moe": {"num_key_value_heads": 16, "sliding_window": 4096, "max_window_layers": 28, "num_experts": 60,
                  "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1},
    "qwen3_next": {"num_key_value_heads": 2, "head_dim": 256, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                   "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_experts": 512,
                   "num_experts_per_tok": 10, "norm_topk_prob": True, "decoder_sparse_step": 1},
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
    if c["model_type"] == "qwen3_next":  # (Hub checkpoints' mtp.* weights, transformers ignores too, go unread)
        return qwen3_next_logits(c, w, tokens)
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
