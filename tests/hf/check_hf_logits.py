#!/usr/bin/env python3
"""megatrain <-> Hugging Face transformers: the same logits both ways, for a tiny GPT-2, a tiny
Llama (GQA, SwiGLU, RoPE, RMSNorm, untied output) and a tiny Qwen2 (Llama with q/k/v biases, tied
output); Mistral (Llama's layout) with and without its sliding window, Qwen2 with a sliding
window on its second layer (--window-size, --window-attn-skip-freq), Nemotron (LayerNorm1P,
squared ReLU, RoPE over half of each head; with biases), Mixtral (every MLP 4 SwiGLU experts,
top-2 softmax routing), Qwen3 (per-head q/k norms), Qwen3-MoE (a dense layer beside MoE layers)
and Qwen2-MoE (top-2 without renormalizing, a gated shared expert), Qwen3-Next (Gated DeltaNet
layers beside gated attention, zero-centred norms, MoE with a gated shared expert), and DeepSeek-V3 (multi-latent attention with a query LoRA; a dense layer,
then MoE layers of 4 experts with sigmoid routing over 2 groups, the expert bias, a scaling factor
and shared experts; imported both with transformers' rope_interleave, as Megatron's MLA rotates,
and without it; and with DeepSeek's YaRN RoPE).

  export: megatrain trains a few steps and saves; `megatrain export-hf` writes the HF directory;
          transformers loads it and must give the logits `megatrain forward-logits` gives.
  import: transformers makes a random model and save_pretrained()s it; `megatrain import-hf`
          converts it; `megatrain forward-logits` must give transformers' logits.

Needs torch and transformers (not megatrain's CI: tests/training_checkpoint_hf_test.cpp checks the
export against tests/hf/numpy_forward.py instead). On the GPU machine, from the checkout:

  python tests/hf/check_hf_logits.py --megatrain build/app/megatrain --device gpu [--bf16] [--forward-bf16]

(--bf16 trains the exported models in bf16; --forward-bf16 runs megatrain's forward in bf16 should
the CUDA backend not take float32; --device cpu runs it all on the reference backend.) Exits 1 on
any mismatch.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch
import transformers

TOKENS = [3, 17, 42, 5, 60, 1, 33, 9, 27, 50, 11, 2]

MODEL_FLAGS = {
    "gpt": "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --openai-gelu",
    "llama": "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
             "--ffn-hidden-size 96 --swiglu --normalization RMSNorm --position-embedding-type rope "
             "--untie-embeddings-and-output-weights --disable-bias-linear",
    "qwen2": "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
             "--ffn-hidden-size 96 --swiglu --normalization RMSNorm --position-embedding-type rope "
             "--disable-bias-linear --add-qkv-bias --rotary-base 1000000 --norm-epsilon 1e-6",
}
MODEL_FLAGS["nemotron"] = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention "
                            "--num-query-groups 2 --ffn-hidden-size 96 --squared-relu --apply-layernorm-1p "
                            "--position-embedding-type rope --rotary-percent 0.5 --untie-embeddings-and-output-weights "
                            "--no-bias-gelu-fusion")
# Windows shorter than TOKENS, so that they change the logits: Mistral's on every layer (HF
# sliding_window 5 = --window-size 4,0), Qwen2's on layer 2 only (max_window_layers 1).
MODEL_FLAGS["mistral_window"] = MODEL_FLAGS["llama"] + " --window-size 4,0"
MODEL_FLAGS["qwen2_window"] = MODEL_FLAGS["qwen2"] + " --window-size 3,0 --window-attn-skip-freq [0,1]"
MODEL_FLAGS["mixtral"] = MODEL_FLAGS["llama"] + " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48"
MODEL_FLAGS["deepseek"] = ("--num-layers 3 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 96 --swiglu "
                           "--normalization RMSNorm --norm-epsilon 1e-6 --position-embedding-type rope "
                           "--untie-embeddings-and-output-weights --disable-bias-linear --multi-latent-attention "
                           "--q-lora-rank 24 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 12 "
                           "--qk-layernorm --rope-type rope --no-rope-fusion --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 "
                           "--moe-layer-freq [0,1,1] --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
                           "--moe-router-bias-update-rate 0.01 --moe-router-topk-scaling-factor 2.5 "
                           "--moe-router-num-groups 2 --moe-router-group-topk 1 --moe-shared-expert-intermediate-size 64")
# Qwen3: Llama with per-head q/k RMSNorms and heads of 24 (not hidden / heads); Qwen3-MoE: a dense
# first layer, then 4 experts top-2 renormalized; Qwen2-MoE: q/k/v biases, every layer 4 experts
# top-2 of the softmax over all (not renormalized) and a shared expert behind its sigmoid gate.
MODEL_FLAGS["qwen3"] = MODEL_FLAGS["llama"] + " --qk-layernorm --kv-channels 24 --norm-epsilon 1e-6"
MODEL_FLAGS["qwen3_moe"] = (MODEL_FLAGS["qwen3"] + " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 "
                            "--moe-layer-freq [0,1]")
MODEL_FLAGS["qwen2_moe"] = (MODEL_FLAGS["qwen2"] + " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 "
                            "--moe-router-pre-softmax --moe-shared-expert-intermediate-size 64 --moe-shared-expert-gate")
# Qwen3-Next: three Gated DeltaNet layers and a gated softmax-attention layer (q/k norms, RoPE over
# a quarter of each head), zero-centred norms; MoE layers of 4 experts top-2 with a gated shared
# expert, the second layer dense.
MODEL_FLAGS["qwen3_next"] = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --group-query-attention "
                             "--num-query-groups 2 --kv-channels 16 --ffn-hidden-size 96 --swiglu --normalization RMSNorm "
                             "--norm-epsilon 1e-6 --apply-layernorm-1p --position-embedding-type rope --rotary-percent 0.25 "
                             "--untie-embeddings-and-output-weights --disable-bias-linear --qk-layernorm "
                             "--attention-output-gate --experimental-attention-variant gated_delta_net "
                             "--linear-attention-freq 4 --linear-num-key-heads 2 --linear-num-value-heads 4 "
                             "--linear-key-head-dim 16 --linear-value-head-dim 8 --num-experts 4 --moe-router-topk 2 "
                             "--moe-ffn-hidden-size 32 --moe-layer-freq [1,0,1,1] --moe-shared-expert-intermediate-size 48 "
                             "--moe-shared-expert-gate")
# With one MTP depth: exported as DeepSeek's checkpoints hold it (model.layers.3.*), which
# transformers must load beside the model (it leaves the depth unused): export only.
MODEL_FLAGS["deepseek_mtp"] = MODEL_FLAGS["deepseek"] + " --mtp-num-layers 1"
# DeepSeek-V3's own RoPE: YaRN with factor 40, mscale and mscale_all_dim 1 (Megatron's MLA default
# type), which transformers reads from rope_scaling.
MODEL_FLAGS["deepseek_yarn"] = (MODEL_FLAGS["deepseek"].replace("--rope-type rope --no-rope-fusion", "--rope-type yarn")
                                + " --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0")


def run(cmd):
    print("+", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        print(r.stdout)
        raise SystemExit(f"command failed with exit status {r.returncode}")
    return r.stdout


def hf_logits(hf_dir):
    try:  # transformers >= 4.56 says dtype=, older ones torch_dtype=
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                                  attn_implementation="eager")
    except TypeError:
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32,
                                                                  attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0].double().numpy()


def megatrain_logits(args, ckpt, out_dir):
    path = os.path.join(out_dir, "logits.npy")
    run([args.megatrain, "forward-logits", "--load", ckpt, "--tokens", ",".join(map(str, TOKENS)), "--output", path,
         "--device", args.device] + (["--bf16"] if args.forward_bf16 else []))
    return np.load(path).astype(np.float64)


def compare(what, got, ref, atol, rtol):
    if got.shape != ref.shape:
        print(f"FAIL {what}: shapes {got.shape} vs {ref.shape}")
        return False
    diff = np.abs(got - ref)
    ok = bool(np.all(diff <= atol + rtol * np.abs(ref))) and np.ptp(ref) > 1e-3
    print(f"{'OK  ' if ok else 'FAIL'} {what}: max |diff| {diff.max():.3e}, largest |logit| {np.abs(ref).max():.3f}")
    return ok


def export_direction(args, kind, work):
    save = os.path.join(work, "ckpt")
    flags = (f"--device {args.device} --mock-data --tokenizer-type NullTokenizer --vocab-size 96 --seq-length 32 "
             f"--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --train-iters 3 "
             f"--save-interval 3 --eval-iters 0 --init-method-std 0.1 --save {save} " + MODEL_FLAGS[kind])
    if args.bf16:
        flags += " --bf16"
    run([args.megatrain] + flags.split())
    hf_dir = os.path.join(work, "hf")
    run([args.megatrain, "export-hf", "--load", save, "--output", hf_dir])
    return compare(f"export {kind}", megatrain_logits(args, save, work), hf_logits(hf_dir), args.atol, args.rtol)


def import_direction(args, kind, work):
    torch.manual_seed(1234)
    if kind == "gpt":
        config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                         activation_function="gelu_new", initializer_range=0.1)
    elif kind in ("deepseek", "deepseek_halves", "deepseek_yarn"):
        extra = {}
        if kind == "deepseek_yarn":  # (rope_scaling: transformers < 5 keeps it, >= 5 reads it into rope_parameters)
            extra = dict(max_position_embeddings=40 * 4096,
                         rope_scaling=dict(rope_type="yarn", type="yarn", factor=40.0, original_max_position_embeddings=4096,
                                           beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0))
        config = transformers.DeepseekV3Config(**{**dict(
            vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=4,
            routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
            qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
            norm_topk_prob=True, max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
            initializer_range=0.1, rope_interleave=kind != "deepseek_halves"), **extra})
    else:
        common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, initializer_range=0.1)
        if kind == "llama":
            config = transformers.LlamaConfig(rms_norm_eps=1e-5, tie_word_embeddings=False, **common)
        elif kind == "qwen2":
            config = transformers.Qwen2Config(rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True, **common)
        elif kind == "qwen2_window":
            config = transformers.Qwen2Config(rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
                                              use_sliding_window=True, sliding_window=4, max_window_layers=1, **common)
        elif kind == "nemotron":
            config = transformers.NemotronConfig(norm_eps=1e-5, partial_rotary_factor=0.5, attention_bias=True,
                                                 mlp_bias=True, tie_word_embeddings=False, **common)
        elif kind == "mixtral":
            config = transformers.MixtralConfig(rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False,
                                                num_local_experts=4, num_experts_per_tok=2, **common)
        elif kind == "qwen3":
            config = transformers.Qwen3Config(rms_norm_eps=1e-6, head_dim=24, tie_word_embeddings=False, **common)
        elif kind == "qwen3_moe":
            config = transformers.Qwen3MoeConfig(rms_norm_eps=1e-6, head_dim=24, tie_word_embeddings=False, num_experts=4,
                                                 num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                                                 mlp_only_layers=[0], **common)
        elif kind == "qwen2_moe":
            config = transformers.Qwen2MoeConfig(rms_norm_eps=1e-6, tie_word_embeddings=True, num_experts=4,
                                                 num_experts_per_tok=2, moe_intermediate_size=48,
                                                 shared_expert_intermediate_size=64, norm_topk_prob=False,
                                                 mlp_only_layers=[1], **common)
        elif kind == "qwen3_next":
            config = transformers.Qwen3NextConfig(**{**common, "num_hidden_layers": 4}, rms_norm_eps=1e-6, head_dim=16,
                                                  partial_rotary_factor=0.25, tie_word_embeddings=False,
                                                  layer_types=["linear_attention"] * 3 + ["full_attention"],
                                                  linear_num_key_heads=2, linear_num_value_heads=4,
                                                  linear_key_head_dim=16, linear_value_head_dim=8,
                                                  linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                                  norm_topk_prob=True, mlp_only_layers=[1])
        elif kind == "mistral_window":
            config = transformers.MistralConfig(rms_norm_eps=1e-5, sliding_window=5, tie_word_embeddings=False,
                                                **common)
        else:
            config = transformers.MistralConfig(rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False,
                                                **common)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # non-trivial norms and biases (a fresh model has ones and zeros there)
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
        # DeepSeek-V3's router bias takes part in the choice. (Kept small: transformers masks the
        # experts of groups it does not pick with 0 where Megatron masks with -inf, which differ
        # only where a picked group's sigmoid score plus bias is negative.)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.02 * torch.randn_like(b))
    hf_dir = os.path.join(work, "hf_made")
    model.save_pretrained(hf_dir, safe_serialization=True)
    save = os.path.join(work, "imported")
    print(run([args.megatrain, "import-hf", "--hf-dir", hf_dir, "--save", save]).strip())
    return compare(f"import {kind}", megatrain_logits(args, save, work), hf_logits(hf_dir), args.atol, args.rtol)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatrain", default="build/app/megatrain")
    ap.add_argument("--device", default="gpu", choices=["gpu", "cpu"])
    ap.add_argument("--bf16", action="store_true", help="train the exported models in bf16 (GPU only)")
    ap.add_argument("--forward-bf16", action="store_true",
                    help="megatrain's forward in bf16 (GPU only; compared with a looser tolerance)")
    ap.add_argument("--atol", type=float, default=None, help="default 2e-5 (5e-2 with --forward-bf16)")
    ap.add_argument("--rtol", type=float, default=None, help="default 1e-4 (2e-2 with --forward-bf16)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directories")
    ap.add_argument("--only", help="comma-separated model kinds (default: all)")
    args = ap.parse_args()
    if args.atol is None:
        args.atol = 5e-2 if args.forward_bf16 else 2e-5
    if args.rtol is None:
        args.rtol = 2e-2 if args.forward_bf16 else 1e-4
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    ok = True
    kinds = args.only.split(",") if args.only else ("gpt", "llama", "qwen2", "mistral", "mistral_window", "qwen2_window",
                                                    "nemotron", "mixtral", "qwen3", "qwen3_moe", "qwen2_moe", "qwen3_next",
                                                    "deepseek",
                                                    "deepseek_halves", "deepseek_yarn", "deepseek_mtp")
    for kind in kinds:
        for direction in (export_direction, import_direction):
            if kind in ("mistral", "deepseek_halves") and direction is export_direction:
                continue  # (export writes Mistral-shaped models as Llama, DeepSeek-V3 with rope_interleave)
            if kind == "deepseek_mtp" and direction is import_direction:
                continue  # (transformers makes no MTP depths)
            work = tempfile.mkdtemp(prefix=f"check_hf_{kind}_")
            try:
                ok = direction(args, kind, work) and ok
            finally:
                if args.keep:
                    print("kept", work)
                else:
                    shutil.rmtree(work, ignore_errors=True)
    print("ALL OK" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
