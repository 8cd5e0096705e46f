#!/usr/bin/env python3
"""Writes a small Megatron-LM torch_dist checkpoint with its (non-distributed) optimizer state,
without PyTorch, for tests/megatron_import_test.cpp's resume case.

  megatron_torch_dist_writer.py OUT_DIR

The layout follows what Megatron-LM (Megatron-Core 0.20) wrote on the GPU machine (bench/RESULTS.md,
2026-11-28): iter_0000007/{metadata.json, .metadata, __0_0.distcp}; every stored item a torch.save
zip archive (data.pkl with persistent storage ids, data/<key>); the model under global keys with
the layers stacked along a leading dimension and one chunk per layer; optimizer.state.{exp_avg,
exp_avg_sq,fp32_param}.<key>; the args, iteration, scheduler and Adam step in a common_state item.
The real files were checked against megatrain on the GPU machine; this writer lets CI reach the
same code. Values are seeded random numbers; the test reads them back through numpy (printed as
JSON: every array's float64 sum and first element, by name).
"""
import argparse
import collections
import io
import json
import os
import pickle
import sys
import types
import zipfile

import numpy as np

# ---- stand-ins for the torch names the pickles reference (never imported from torch) ----------


def _module(name):
    m = types.ModuleType(name)
    sys.modules[name] = m
    return m


torch = _module("torch")
torch_utils = _module("torch._utils")
dcp_meta = _module("torch.distributed.checkpoint.metadata")
dcp_fs = _module("torch.distributed.checkpoint.filesystem")


def _rebuild_tensor_v2(*args):
    raise NotImplementedError


_rebuild_tensor_v2.__module__ = "torch._utils"
torch_utils._rebuild_tensor_v2 = _rebuild_tensor_v2


def _in(module, cls):
    cls.__module__ = module.__name__
    setattr(module, cls.__name__, cls)
    return cls


FloatStorage = _in(torch, type("FloatStorage", (), {}))
BFloat16Storage = _in(torch, type("BFloat16Storage", (), {}))
LongStorage = _in(torch, type("LongStorage", (), {}))


class Size(tuple):
    def __reduce__(self):
        return (Size, (tuple(self),))


_in(torch, Size)


class _Record:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _record(module, name, hashable=False):
    cls = type(name, (_Record,), {})
    if hashable:
        cls.__hash__ = lambda self: hash(tuple(sorted((k, repr(v)) for k, v in self.__dict__.items())))
        cls.__eq__ = lambda self, other: self.__dict__ == other.__dict__
    return _in(module, cls)


Metadata = _record(dcp_meta, "Metadata")
TensorStorageMetadata = _record(dcp_meta, "TensorStorageMetadata")
BytesStorageMetadata = _record(dcp_meta, "BytesStorageMetadata")
ChunkStorageMetadata = _record(dcp_meta, "ChunkStorageMetadata")
MetadataIndex = _record(dcp_meta, "MetadataIndex", hashable=True)
StorageInfo = _in(dcp_fs, type("_StorageInfo", (_Record,), {}))

# ---- torch.save's format -------------------------------------------------------------------


class _Storage:
    def __init__(self, key, array):
        self.key, self.array = key, array


class _Tensor:
    def __init__(self, storage, shape):
        self.storage, self.shape = storage, shape

    def __reduce__(self):
        stride, s = [], 1
        for d in reversed(self.shape):
            stride.insert(0, s)
            s *= d
        return (_rebuild_tensor_v2, (self.storage, 0, Size(self.shape), tuple(stride), False, collections.OrderedDict()))


_STORAGE_TYPES = {"float32": FloatStorage, "bfloat16": BFloat16Storage, "int64": LongStorage}


def torch_save(obj_builder):
    """obj_builder(tensor) -> the object; tensor(array, dtype) makes a pickled tensor."""
    storages = []

    def tensor(array, dtype="float32"):
        if dtype == "bfloat16":  # round-to-nearest-even float32 -> bfloat16 bits
            bits = array.astype(np.float32).view(np.uint32)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            data = bits
        else:
            data = array.astype(dtype)
        st = _Storage(str(len(storages)), data)
        st.type = _STORAGE_TYPES[dtype]
        storages.append(st)
        return _Tensor(st, list(array.shape))

    obj = obj_builder(tensor)
    buf = io.BytesIO()

    class P(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, _Storage):
                return ("storage", o.type, o.key, "cpu", int(o.array.size))
            return None

    P(buf, protocol=2).dump(obj)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/byteorder", "little")
        for st in storages:
            z.writestr(f"archive/data/{st.key}", st.array.tobytes())
        z.writestr("archive/version", "3\n")
    return out.getvalue()


# ---- the checkpoint --------------------------------------------------------------------------

LAYERS, HIDDEN, FFN, HEADS, GROUPS, VOCAB, PADDED = 2, 32, 64, 4, 2, 60, 64
HEAD_DIM = HIDDEN // HEADS
QKV = (HEADS + 2 * GROUPS) * HEAD_DIM
ITERATION, STEP = 7, 7
# (key, per-layer shape or None for a non-layer tensor)
SHAPES = {
    "embedding.word_embeddings.weight": [PADDED, HIDDEN],
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": [HIDDEN],
    "decoder.layers.self_attention.linear_qkv.weight": [QKV, HIDDEN],
    "decoder.layers.self_attention.linear_proj.weight": [HIDDEN, HIDDEN],
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": [HIDDEN],
    "decoder.layers.mlp.linear_fc1.weight": [2 * FFN, HIDDEN],
    "decoder.layers.mlp.linear_fc2.weight": [HIDDEN, FFN],
    "decoder.final_layernorm.weight": [HIDDEN],
    "output_layer.weight": [PADDED, HIDDEN],
}
ARGS = dict(num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
            kv_channels=HEAD_DIM, group_query_attention=True, num_query_groups=GROUPS, max_position_embeddings=32,
            seq_length=32, position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0, normalization="RMSNorm",
            norm_epsilon=1e-5, swiglu=True, add_bias_linear=False, add_qkv_bias=False,
            untie_embeddings_and_output_weights=True, bias_gelu_fusion=False, attention_dropout=0.0, hidden_dropout=0.0,
            init_method_std=0.02, make_vocab_size_divisible_by=32, padded_vocab_size=PADDED, num_experts=None,
            tokenizer_type="NullTokenizer", vocab_size=VOCAB, tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1, data_parallel_size=1, micro_batch_size=2, global_batch_size=4,
            consumed_train_samples=ITERATION * 4, consumed_valid_samples=0, seed=1234, bf16=True, fp16=False,
            optimizer="adam", lr=1e-3, lr_warmup_init=0.0, lr_wsd_decay_style="exponential")
SCHEDULER = {"max_lr": 1e-3, "lr_warmup_steps": 8, "num_steps": ITERATION * 4, "lr_decay_style": "cosine",
             "lr_decay_steps": 80, "min_lr": 1e-4, "start_wd": 0.01, "end_wd": 0.01, "wd_incr_style": "constant",
             "wd_incr_steps": 32}  # Megatron: the run's train samples (8 iterations of 4)


def main():
    out = sys.argv[1]
    rng = np.random.default_rng(24)
    it_dir = os.path.join(out, f"iter_{ITERATION:07d}")
    os.makedirs(it_dir)
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(ITERATION))
    with open(os.path.join(it_dir, "metadata.json"), "w") as f:
        f.write('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')

    blob = io.BytesIO()
    sdm, storage = {}, {}
    expected = {}

    def put(fqn, data, offsets=None):
        at = blob.tell()
        blob.write(data)
        storage[MetadataIndex(fqn=fqn, offset=Size(offsets) if offsets is not None else None, index=None)] = \
            StorageInfo(relative_path="__0_0.distcp", offset=at, length=len(data))

    def tensor_item(fqn, array, dtype, name_for_expected):
        # stacked layer tensors: one chunk per layer, as Megatron stores them
        layered = "decoder.layers." in fqn
        full = array
        if layered:
            chunks = [(full[l:l + 1], [l] + [0] * (full.ndim - 1)) for l in range(full.shape[0])]
        else:
            chunks = [(full, [0] * full.ndim)]
        for part, off in chunks:
            put(fqn, torch_save(lambda t, p=part: t(p, dtype)), off)
        sdm[fqn] = TensorStorageMetadata(properties=None, size=Size(full.shape),
                                         chunks=[ChunkStorageMetadata(offsets=Size(o), sizes=Size(p.shape))
                                                 for p, o in chunks])
        if layered:
            for l in range(full.shape[0]):
                expected[name_for_expected(l)] = full[l]
        else:
            expected[name_for_expected(None)] = full

    for key, shape in SHAPES.items():
        layered = key.startswith("decoder.layers.")
        full_shape = [LAYERS] + shape if layered else shape
        # the model weights are the float32 main weights rounded to bf16, as Megatron keeps them
        main = rng.standard_normal(full_shape).astype(np.float32) * 0.02
        states = {"": ("bfloat16", main),
                  "optimizer.state.exp_avg.": ("float32", rng.standard_normal(full_shape).astype(np.float32) * 1e-3),
                  "optimizer.state.exp_avg_sq.": ("float32", rng.random(full_shape).astype(np.float32) * 1e-6),
                  "optimizer.state.fp32_param.": ("float32", main)}
        for prefix, (dtype, array) in states.items():
            def name(l, prefix=prefix, key=key):
                ours = key if l is None else key.replace("decoder.layers.", f"decoder.layers.{l}.")
                return (prefix.split(".")[-2] + "/" if prefix else "model/") + ours
            tensor_item(prefix + key, array, dtype, name)

    args = argparse.Namespace(**ARGS)
    common = torch_save(lambda t: [{
        "args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
        "optimizer": {"optimizer": {"state": {"common_step": t(np.array(STEP), "int64")},
                                    "param_groups": [{"wd_mult": 1.0, "lr": 1e-3}]}},
        "opt_param_scheduler": SCHEDULER, "num_floating_point_operations_so_far": 1.5e12}])
    put("common_state/shard_0_1", common)
    sdm["common_state/shard_0_1"] = BytesStorageMetadata()

    with open(os.path.join(it_dir, "__0_0.distcp"), "wb") as f:
        f.write(blob.getvalue())
    meta = Metadata(state_dict_metadata=sdm, planner_data=None, storage_data=storage, storage_meta=None, version="1.0.0")
    with open(os.path.join(it_dir, ".metadata"), "wb") as f:
        pickle.dump(meta, f, protocol=4)
    # bfloat16 values as stored (the model), float32 otherwise
    summary = {}
    for name, a in expected.items():
        a = a.astype(np.float32)
        if name.startswith("model/"):
            bits = a.view(np.uint32)
            a = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint32) << 16).view(np.float32)
        summary[name] = {"sum": float(a.astype(np.float64).sum()), "first": float(a.reshape(-1)[0]),
                         "shape": list(a.shape)}
    json.dump(summary, sys.stdout)


if __name__ == "__main__":
    main()
