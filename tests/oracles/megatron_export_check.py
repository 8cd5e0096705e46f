#!/usr/bin/env python3
"""Checks a Megatron-LM torch-format checkpoint written by `megatrain export-megatron` against the
megatrain checkpoint it came from, without PyTorch (numpy only), for tests/megatron_export_test.cpp.

  megatron_export_check.py MEGATRAIN_CKPT_ITERATION_DIR MEGATRON_SAVE_DIR [--torch]

What torch.load(weights_only=True) needs of every .pt file, checked as it checks them:
  * a zip archive (CRC-checked) whose entries sit in one folder, data.pkl first, a "version"
    record, byteorder "little", every storage's bytes at a multiple of 64;
  * a protocol-2 pickle of only the opcodes the weights-only unpickler executes, naming only the
    globals it allows (plus argparse.Namespace, which Megatron-LM allowlists); no memo.
Then, independently of megatrain's C++ (safetensors read by hand, Megatron's rules rewritten here):
  * each model chunk's tensors are the tensor-parallel shards of megatrain's global tensors
    (linear_qkv, linear_fc1 - per half with SwiGLU -, word embeddings and output layer by rows;
    linear_proj, linear_fc2 by columns), under the local spec's names and stage-local layer
    numbers (an even pipeline split);
  * torch's Adam state: parameter i of the rank is the i-th of the weight-decay group then of the
    no-weight-decay group (biases and 1-D), each in state-dict order; exp_avg / exp_avg_sq equal
    megatrain's shards, and the step megatrain's count;
  * distrib_optim.pt (one bucket per chunk): the parameters laid out in reverse order, each start
    rounded up to 64 elements, holding the main weights and moments;
  * rng_state: Python's random.seed(s) and numpy.random.seed(s) states, s = seed + 100 x stage.
With --torch, also torch.load(weights_only=True) of every file (argparse.Namespace allowlisted) and
the same tensors. Prints a JSON summary; exits 1 listing the problems.
"""
import argparse
import io
import json
import os
import pickle
import pickletools
import random
import re
import struct
import sys
import zipfile

import numpy as np

# The opcodes torch/_weights_only_unpickler.py executes (protocol 2 and the ones it also reads).
ALLOWED_OPS = {"PROTO", "STOP", "GLOBAL", "NEWOBJ", "REDUCE", "BUILD", "APPEND", "APPENDS", "SETITEM", "SETITEMS",
               "MARK", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE", "NEWFALSE", "NEWTRUE", "EMPTY_TUPLE",
               "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "BININT", "BININT1", "BININT2", "BINFLOAT", "BINUNICODE",
               "SHORT_BINSTRING", "BINPERSID", "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT", "LONG1"}
STORAGES = {"FloatStorage": np.float32, "BFloat16Storage": "bf16", "HalfStorage": np.float16,
            "DoubleStorage": np.float64, "LongStorage": np.int64, "IntStorage": np.int32, "ByteStorage": np.uint8}
ALLOWED_GLOBALS = {"collections.OrderedDict", "torch._utils._rebuild_tensor_v2", "_codecs.encode", "builtins.set",
                   "argparse.Namespace"} | {"torch." + s for s in STORAGES} | \
    {"torch." + t for t in ("float32", "bfloat16", "float16", "float64", "int64", "int32", "uint8")}

problems = []


def problem(text):
    problems.append(text)


class Tensor:
    def __init__(self, array):
        self.array = array


class Unpickler(pickle.Unpickler):
    def __init__(self, data, storages):
        super().__init__(io.BytesIO(data))
        self.storages = storages

    def find_class(self, module, name):
        full = module + "." + name
        if full not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError("global " + full + " is not allowed by torch.load(weights_only=True)")
        if full == "torch._utils._rebuild_tensor_v2":
            return rebuild_tensor
        if module == "torch":
            return ("torch", name)
        if full == "argparse.Namespace":
            return argparse.Namespace
        return super().find_class(module, name)

    def persistent_load(self, pid):
        kind, storage_type, key, location, numel = pid
        if kind != "storage" or location != "cpu":
            raise pickle.UnpicklingError("unexpected storage id %r" % (pid,))
        raw = self.storages[key]
        dtype = STORAGES[storage_type[1].replace("torch.", "")]
        if dtype == "bf16":
            array = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            array = np.frombuffer(raw, dtype)
        if array.size != numel:
            raise pickle.UnpicklingError("storage %s holds %d elements, the id says %d" % (key, array.size, numel))
        return array


def rebuild_tensor(storage, offset, size, stride, requires_grad, hooks, *rest):
    n = int(np.prod(size)) if size else 1
    expect = tuple(int(np.prod(size[i + 1:])) for i in range(len(size)))
    if tuple(stride) != expect:
        raise pickle.UnpicklingError("a non-contiguous tensor")
    return Tensor(storage[offset:offset + n].reshape(size))


def read_pt(path):
    z = zipfile.ZipFile(path)
    bad = z.testzip()
    if bad:
        problem("%s: CRC error in %s" % (path, bad))
    names = z.namelist()
    folder = names[0].split("/")[0]
    if names[0] != folder + "/data.pkl":
        problem("%s: the first entry is %s, not %s/data.pkl" % (path, names[0], folder))
    if any(not n.startswith(folder + "/") for n in names):
        problem("%s: entries outside the folder %s" % (path, folder))
    if z.read(folder + "/version") != b"3\n" or z.read(folder + "/byteorder") != b"little":
        problem("%s: version or byteorder record wrong" % path)
    raw = open(path, "rb").read()
    storages = {}
    for info in z.infolist():
        if info.compress_type != zipfile.ZIP_STORED:
            problem("%s: %s is compressed" % (path, info.filename))
        name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
        start = info.header_offset + 30 + name_len + extra_len
        if info.filename.startswith(folder + "/data/"):
            if start % 64:
                problem("%s: %s starts at byte %d, not a multiple of 64" % (path, info.filename, start))
            storages[info.filename[len(folder) + 6:]] = z.read(info.filename)
    data = z.read(folder + "/data.pkl")
    for op, arg, pos in pickletools.genops(data):
        if op.name not in ALLOWED_OPS:
            problem("%s: opcode %s at %d, which torch.load(weights_only=True) refuses" % (path, op.name, pos))
        if op.name in ("BINPUT", "LONG_BINPUT", "MEMOIZE"):
            problem("%s: a memo opcode" % path)
    if data[:2] != b"\x80\x02":
        problem("%s: not pickle protocol 2" % path)
    return Unpickler(data, storages).load()


def read_megatrain(iteration_dir):
    """Global tensors of a single-process megatrain checkpoint, by (kind, name)."""
    manifest = json.load(open(os.path.join(iteration_dir, "manifest.json")))
    files = {}
    out = {}
    for t in manifest["tensors"]:
        whole = np.zeros(int(np.prod(t["global_shape"])), dtype=np.float32)
        for s in t["shards"]:
            if s["flat_begin"] != 0 or s["row_offset"] or s["col_offset"] or s["local_rows"] * s["chunks"] != t["global_rows"]:
                raise SystemExit("read_megatrain: only whole-tensor shards (a one-process save)")
            if s["file"] not in files:
                raw = open(os.path.join(iteration_dir, s["file"]), "rb").read()
                n = struct.unpack("<Q", raw[:8])[0]
                files[s["file"]] = (json.loads(raw[8:8 + n]), raw[8 + n:])
            header, body = files[s["file"]]
            h = header[s["key"]]
            if h["dtype"] != "F32":
                raise SystemExit("read_megatrain: float32 checkpoints only")
            b, e = h["data_offsets"]
            whole[:] = np.frombuffer(body[b:e], np.float32)
        out[(t["kind"], t["name"])] = whole.reshape(t["global_shape"])
    return manifest, out


def te_name(local):
    for a, b in (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                 ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")):
        if local.startswith(a):
            return b + local[len(a):]
    return local


def shard(name, array, tp, rank, swiglu):
    rows = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias")
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")) and swiglu:
        gate, up = np.split(array, 2, axis=0)
        return np.concatenate([np.split(gate, tp, axis=0)[rank], np.split(up, tp, axis=0)[rank]], axis=0)
    if name.endswith(rows) or name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return np.split(array, tp, axis=0)[rank]
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return np.split(array, tp, axis=1)[rank]
    return array


def main():
    cli = argparse.ArgumentParser()
    cli.add_argument("megatrain")
    cli.add_argument("megatron")
    cli.add_argument("--torch", action="store_true")
    a = cli.parse_args()
    manifest, ours = read_megatrain(a.megatrain)
    step = manifest["run_state"]["extra"]["optimizer"]["successful_steps"]
    tracker = open(os.path.join(a.megatron, "latest_checkpointed_iteration.txt")).read()
    it_dir = os.path.join(a.megatron, "iter_%07d" % int(tracker))
    checked = {"files": 0, "tensors": 0, "states": 0}
    for rank_dir in sorted(os.listdir(it_dir)):
        m = re.fullmatch(r"mp_rank_(\d\d)(?:_(\d\d\d))?", rank_dir)
        if not m:
            problem("unexpected entry " + rank_dir)
            continue
        t, p = int(m.group(1)), int(m.group(2) or 0)
        path = os.path.join(it_dir, rank_dir, "model_optim_rng.pt")
        sd = read_pt(path)
        checked["files"] += 1
        args = sd["args"]
        tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
        vpp = args.virtual_pipeline_model_parallel_size or 1
        per_chunk = args.num_layers // (pp * vpp)
        tied = not args.untie_embeddings_and_output_weights
        chunks = [sd["model"]] if "model" in sd else [sd["model%d" % v] for v in range(vpp)]
        params = []  # (megatrain name, local tensor) in state-dict order over the chunks
        for v, chunk in enumerate(chunks):
            first = (v * pp + p) * per_chunk
            for key, value in chunk.items():
                if key.endswith("._extra_state"):
                    if value is not None:
                        problem("%s: %s is not None" % (path, key))
                    continue
                mm = re.fullmatch(r"decoder\.layers\.(\d+)\.(.*)", key)
                name = "decoder.layers.%d.%s" % (first + int(mm.group(1)), te_name(mm.group(2))) if mm else key
                if tied and name == "output_layer.weight":
                    name = "embedding.word_embeddings.weight"
                want = shard(name, ours[("model", name)], tp, t, args.swiglu)
                if not isinstance(value, Tensor) or value.array.shape != want.shape or not np.array_equal(value.array, want):
                    problem("%s: %s is not the tensor-parallel shard of megatrain's %s" % (path, key, name))
                params.append((name, want.shape))
                checked["tensors"] += 1
        opt = sd.get("optimizer")
        if opt is not None and not args.use_distributed_optimizer:
            adam = opt["optimizer"] if "optimizer" in opt else opt
            decay = [n for n, s in params if not (n.endswith(".bias") or len(s) == 1)]
            no_decay = [n for n, s in params if n.endswith(".bias") or len(s) == 1]
            order = decay + no_decay
            groups = adam["param_groups"]
            if [g["params"] for g in groups] != [list(range(len(decay))), list(range(len(decay), len(order)))]:
                problem("%s: param groups %s" % (path, [g["params"] for g in groups]))
            if [g["wd_mult"] for g in groups] != [1.0, 0.0]:
                problem("%s: wd_mult %s" % (path, [g["wd_mult"] for g in groups]))
            for i, name in enumerate(order):
                s = adam["state"][i]
                for k in ("exp_avg", "exp_avg_sq"):
                    want = shard(name, ours[("optim", name + "." + k)], tp, t, args.swiglu)
                    if not np.array_equal(s[k].array, want):
                        problem("%s: state %d %s is not megatrain's %s.%s" % (path, i, k, name, k))
                if float(s["step"].array) != step:
                    problem("%s: state %d step %s, not %d" % (path, i, s["step"].array, step))
                checked["states"] += 1
        if opt is not None and args.use_distributed_optimizer:
            if args.overlap_grad_reduce or (tied and pp > 1):
                raise SystemExit("the oracle lays out one bucket per chunk, untied")
            buffers = read_pt(os.path.join(it_dir, rank_dir, "distrib_optim.pt"))
            checked["files"] += 1
            if buffers["buckets_coalesced"] is not True:
                problem("distrib_optim.pt: buckets_coalesced")
            at = 0
            for v, chunk in enumerate(chunks):
                names = [n for n, _ in params[at:]][:sum(1 for k in chunk if not k.endswith("_extra_state"))]
                at += len(names)
                (dtypes, states), = buffers[v].items()
                offset, where = 0, {}
                for name in reversed(names):
                    offset = (offset + 63) // 64 * 64
                    where[name] = offset
                    offset += shard(name, ours[("model", name)], tp, t, args.swiglu).size
                if states["numel_unpadded"] != offset:
                    problem("distrib_optim.pt chunk %d: numel_unpadded %d, the layout makes %d"
                            % (v, states["numel_unpadded"], offset))
                for k, kind, suffix in (("param", "model", ""), ("exp_avg", "optim", ".exp_avg"),
                                        ("exp_avg_sq", "optim", ".exp_avg_sq")):
                    for name in names:
                        want = shard(name, ours[(kind, name + suffix)], tp, t, args.swiglu).ravel()
                        got = states[k].array[where[name]:where[name] + want.size]
                        if not np.array_equal(got, want):
                            problem("distrib_optim.pt chunk %d: %s of %s misplaced" % (v, k, name))
                        checked["states"] += 1
        if "rng_state" in sd:
            seed = args.seed + 100 * p
            r = sd["rng_state"][0]
            random.seed(seed)
            if r["random_rng_state"] != random.getstate():
                problem("%s: random_rng_state is not random.seed(%d)'s" % (path, seed))
            np.random.seed(seed)
            want = np.random.get_state()
            if list(r["np_rng_state"][1]) != [int(x) for x in want[1]] or tuple(r["np_rng_state"][2:]) != want[2:]:
                problem("%s: np_rng_state is not numpy.random.seed(%d)'s" % (path, seed))
            if r["torch_rng_state"].array.size != 5056 or r["cuda_rng_state"].array.size != 16:
                problem("%s: torch/cuda RNG state sizes" % path)
        if a.torch:
            import torch  # noqa: E402  (only with --torch)
            with torch.serialization.safe_globals([argparse.Namespace]):
                loaded = torch.load(path, map_location="cpu", weights_only=True)
            for v, chunk in enumerate(chunks):
                theirs = loaded["model"] if "model" in loaded else loaded["model%d" % v]
                for key, value in chunk.items():
                    if isinstance(value, Tensor):
                        got = theirs[key].float().numpy()
                        if not np.array_equal(got, value.array.astype(np.float32)):
                            problem("%s: torch.load reads %s differently" % (path, key))
            if "rng_state" in loaded:
                torch.set_rng_state(loaded["rng_state"][0]["torch_rng_state"])
                random.setstate(loaded["rng_state"][0]["random_rng_state"])
                np.random.set_state(loaded["rng_state"][0]["np_rng_state"])
            if args.use_distributed_optimizer:
                torch.load(os.path.join(it_dir, rank_dir, "distrib_optim.pt"), weights_only=True)
            checked["torch"] = True
    print(json.dumps({"checked": checked, "problems": problems}))
    sys.exit(1 if problems or checked["files"] == 0 else 0)


if __name__ == "__main__":
    main()
