#!/usr/bin/env python3
"""Runs Megatron-LM's pretrain_gpt.py (from the current directory) with a plain PyTorch core attention
in its local layer spec, for multi-latent attention without Transformer Engine.

Megatron-LM's MLA passes its core attention query/key and value head sizes of their own
(k_channels, v_channels), which only Transformer Engine's attention accepts: the local spec's
DotProductAttention does not. bench/megatron_equivalence.sh's mla case launches this instead of
pretrain_gpt.py so that Megatron-LM's own MLA (its projections, norms, YaRN RoPE and softmax scale)
trains on a machine without Transformer Engine. The stand-in is causal softmax(Q K^T * scale) V
with the scale MLA hands it, computed in the inputs' dtype as Megatron's unfused attention does
(scores in float32 with --attention-softmax-in-fp32 or float32 models).
"""
import math
import os
import runpy
import sys

import torch

sys.path.insert(0, os.getcwd())
import megatron.core.models.backends as backends  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402


class PlainCoreAttention(MegatronModule):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None,
                 **kwargs):
        super().__init__(config=config)
        assert config.context_parallel_size == 1, "the stand-in attention has no context parallelism"
        d = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
        self.dropout = torch.nn.Dropout(config.attention_dropout if attention_dropout is None else attention_dropout)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        assert packed_seq_params is None and attention_bias is None
        s, b = query.shape[0], query.shape[1]
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.softmax_scale
        causal = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        out = torch.matmul(self.dropout(probs).to(v.dtype), v)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


backends.DotProductAttention = PlainCoreAttention
sys.argv[0] = "pretrain_gpt.py"
runpy.run_path("pretrain_gpt.py", run_name="__main__")
