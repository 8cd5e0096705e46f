#!/usr/bin/env python3
"""Writes tests/fixtures/megatron_cyclic_sampler.json: the sample order of Megatron-LM's own
MegatronPretrainingRandomSampler (--dataloader-type cyclic) behind its cyclic_iter, and torch.randperm
with seeded generators, for tests/batch_loader_test.cpp.

    python3 tests/oracles/megatron_cyclic_sampler.py PATH/TO/data_samplers.py > megatron_cyclic_sampler.json

PATH/TO/data_samplers.py is megatron/training/datasets/data_samplers.py of a Megatron-LM checkout.
It needs torch; the Megatron modules that file imports (mpu, get_args, Split, the signal handler)
are not used by the sampler and are stood in for here, so no GPU and no Megatron install is needed.
"""
import enum
import importlib.util
import json
import sys
import types

import torch


def load_sampler_module(path):
    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    class Split(enum.Enum):
        train = 0
        valid = 1
        test = 2

    module("megatron")
    module("megatron.core", mpu=module("megatron.core.mpu"))
    module("megatron.core.datasets")
    module("megatron.core.datasets.utils", Split=Split)
    module("megatron.training", get_args=lambda: None)
    module("megatron.training.dist_signal_handler", DistributedSignalHandler=object)
    spec = importlib.util.spec_from_file_location("data_samplers", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def cyclic(sampler):
    # Megatron's cyclic_iter: a new pass over the sampler each time one runs out.
    while True:
        n = 0
        for batch in sampler:
            n += 1
            yield batch
        if n == 0:
            raise RuntimeError("empty pass")


def main():
    samplers = load_sampler_module(sys.argv[1])
    out = {"randperm": [], "cases": []}
    for n in [1, 2, 3, 10, 100, 1000, 4097]:
        for seed in [0, 1, 7, 123456789, 2**33 + 5]:
            g = torch.Generator()
            g.manual_seed(seed)
            out["randperm"].append({"n": n, "seed": seed, "perm": torch.randperm(n, generator=g).tolist()})
    # samples, micro-batch, DP, consumed samples, data sharding, micro-batches per rank
    cases = [
        (50, 1, 1, 0, True, 120),
        (103, 2, 3, 0, True, 45),
        (103, 2, 3, 36, True, 30),
        (103, 2, 3, 96, True, 20),
        (64, 4, 2, 0, True, 20),
        (103, 2, 3, 0, False, 45),
        (103, 2, 3, 42, False, 30),
        (10, 1, 4, 0, False, 8),
        (29, 3, 2, 12, False, 12),
    ]
    for samples, mbs, dp, consumed, sharding, k in cases:
        ranks = []
        for r in range(dp):
            s = samplers.MegatronPretrainingRandomSampler(
                list(range(samples)), total_samples=samples, consumed_samples=consumed, micro_batch_size=mbs,
                data_parallel_rank=r, data_parallel_size=dp, data_sharding=sharding)
            it = cyclic(s)
            ranks.append([next(it) for _ in range(k)])
        out["cases"].append({"samples": samples, "micro_batch_size": mbs, "data_parallel_size": dp,
                             "consumed_samples": consumed, "data_sharding": sharding, "ranks": ranks})
    out["torch"] = torch.__version__
    json.dump(out, sys.stdout, separators=(",", ":"))


if __name__ == "__main__":
    main()
