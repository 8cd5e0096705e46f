"""Oracle for megatrain's data pipeline: Megatron-LM's GPTDataset / BlendedDataset / mock-data sample
order, written from the algorithm (Megatron-LM's megatron/core/datasets/gpt_dataset.py, blended_dataset.py)
with numpy's own RandomState, default_rng and numpy.sum. Independent of megatrain's C++ (it reads
the .bin/.idx files itself).

Usage: megatron_gpt_indices.py SPEC.json      (prints one JSON object; a JSON list of specs gives a
                                              list of outputs)
SPEC keys:
  data_path          list of strings (--data-path: prefixes, or weight prefix pairs)
  split              --split text (default '969, 30, 1' with data_path)
  train_data_path / valid_data_path / test_data_path   lists (per-split blends)
  mock               {"vocab_size": V, "eod": E}  (--mock-data; split forced to 1,1,1)
  sizes              [train, valid, test] sample counts (ints or null)
  seq_length, seed, surplus (default 0.005), pad (default -1)
  windows            how many windows to print per split (-1 = all)
  split_ranges       optional: {"splits": [text...], "elements": [E...]} -> prints the split ranges
                     instead: {"ranges": [per split text: [per E: [[beg, end] or null] x 3]]}
Output: {"train": {"size": n, "windows": [[token, ...], ...]} or null, "valid": ..., "test": ...}
"""
import json
import math
import re
import struct
import sys

import numpy

SPLITS = ["train", "valid", "test"]
DTYPES = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32, 5: numpy.int64,
          6: numpy.float64, 7: numpy.float32, 8: numpy.uint16}


# ---- low-level datasets ----------------------------------------------------------------------

class Indexed:
    """The .bin/.idx pair, read with numpy from the layout description."""

    def __init__(self, prefix):
        self.prefix = prefix
        with open(prefix + ".idx", "rb") as f:
            assert f.read(9) == b"MMIDIDX\x00\x00"
            assert struct.unpack("<Q", f.read(8))[0] == 1
            self.dtype = DTYPES[struct.unpack("<B", f.read(1))[0]]
            n = struct.unpack("<Q", f.read(8))[0]
            d = struct.unpack("<Q", f.read(8))[0]
        buf = numpy.memmap(prefix + ".idx", mode="r")
        self.lengths = numpy.frombuffer(buf, numpy.int32, n, 34).copy()
        self.pointers = numpy.frombuffer(buf, numpy.int64, n, 34 + 4 * n).copy()
        self.doc_indices = numpy.frombuffer(buf, numpy.int64, d, 34 + 12 * n).copy()
        assert self.doc_indices[-1] == n
        self.bin = numpy.memmap(prefix + ".bin", mode="r", dtype=numpy.uint8)
        self.itemsize = numpy.dtype(self.dtype).itemsize

    def numel(self):
        return len(self.lengths)

    def get(self, i, offset=0, length=None):
        if length is None:
            length = self.lengths[i] - offset
        start = int(self.pointers[i]) + int(offset) * self.itemsize
        return numpy.frombuffer(self.bin, self.dtype, int(length), start).astype(numpy.int64)


class Mock:
    """MockGPTLowLevelDataset: lengths from default_rng(0).integers(1, 4096, 100000, int32)."""

    def __init__(self, vocab_size, eod):
        self.vocab_size, self.eod = vocab_size, eod
        rng = numpy.random.default_rng(seed=0)
        self.lengths = rng.integers(low=1, high=4096, size=100000, dtype=numpy.int32)

    def numel(self):
        return len(self.lengths)

    def get(self, i, offset=0, length=None):
        n = self.lengths[i]
        if length is None:
            length = n - offset
        doc = numpy.concatenate([(numpy.arange(n - 1) + 1) % self.vocab_size, [self.eod]]).astype(numpy.int64)
        return doc[offset:offset + length]


# ---- split -------------------------------------------------------------------------------------

def normalize(weights):
    w = numpy.array(weights, dtype=numpy.float64)
    return (w / numpy.sum(w)).tolist()


def parse_split(text):
    split = [float(x) for x in re.findall(r"[.0-9]+", text)]
    split = split + [0.0] * (3 - len(split))
    assert len(split) == 3
    return normalize(split)


def split_matrix(vector):
    expansion = [0]
    for w in vector:
        expansion.append(expansion[-1] + w)
    matrix = []
    for a, b in zip(expansion[:-1], expansion[1:]):
        matrix.append(None if b <= a else (a, b))
    return matrix


def split_indices(bookend, numel):
    beg = int(round(bookend[0] * float(numel)))
    end = int(round(bookend[1] * float(numel)))
    return numpy.arange(beg, end, dtype=numpy.int32)


# ---- GPTDataset --------------------------------------------------------------------------------

class GPT:
    def __init__(self, low, indices, num_samples, seq_length, seed, pad):
        self.low, self.s, self.pad = low, seq_length, pad
        tokens_per_epoch = int(numpy.sum(low.lengths[indices]))
        epochs = 1
        if num_samples is not None:
            total = tokens_per_epoch
            while total < num_samples * seq_length + 1:
                epochs += 1
                total += tokens_per_epoch
        separate = False
        if epochs > 1:
            before = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
            final = num_samples - before
            per_epoch = (tokens_per_epoch - 1) // seq_length
            assert 0 <= final <= per_epoch + 1
            separate = final < int(0.80 * per_epoch)
        rng = numpy.random.RandomState(seed)
        self.doc_index = self._document_index(indices, epochs, rng, separate)
        self.sample_index = self._sample_index(low.lengths, self.doc_index, seq_length, epochs, tokens_per_epoch)
        count = len(self.sample_index) - 1
        self.shuffle_index = self._shuffle_index(before if separate else count, count, rng)
        self.epochs, self.separate, self.tokens_per_epoch = epochs, separate, tokens_per_epoch

    @staticmethod
    def _document_index(documents, epochs, rng, separate):
        if not separate or epochs == 1:
            index = numpy.tile(documents, epochs).astype(numpy.int32)
            rng.shuffle(index)
            return index
        first = GPT._document_index(documents, epochs - 1, rng, False)
        last = GPT._document_index(documents, 1, rng, False)
        return numpy.concatenate((first, last))

    @staticmethod
    def _sample_index(sizes, doc_index, s, epochs, tokens_per_epoch):
        count = (epochs * tokens_per_epoch - 1) // s
        out = [(0, 0)]
        di, off = 0, 0
        for _ in range(count):
            remaining = s + 1
            while remaining != 0:
                doc_len = int(sizes[doc_index[di]]) - off
                remaining -= doc_len
                if remaining <= 0:
                    off += remaining + doc_len - 1
                    remaining = 0
                else:
                    assert di != len(doc_index) - 1
                    di += 1
                    off = 0
            out.append((di, off))
        return out

    @staticmethod
    def _shuffle_index(num_samples, total, rng):
        dtype = numpy.uint32 if total < numpy.iinfo(numpy.uint32).max - 1 else numpy.int64
        first = numpy.arange(0, num_samples, dtype=dtype)
        rng.shuffle(first)
        if num_samples == total:
            return first
        last = numpy.arange(num_samples, total, dtype=dtype)
        rng.shuffle(last)
        return numpy.concatenate((first, last))

    def __len__(self):
        return len(self.sample_index) - 1

    def window(self, idx):
        j = int(self.shuffle_index[idx])
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        parts = []
        if d0 == d1:
            parts.append(self.low.get(self.doc_index[d0], o0, o1 - o0 + 1))
        else:
            for i in range(d0, d1 + 1):
                parts.append(self.low.get(self.doc_index[i], 0 if i > d0 else o0, None if i < d1 else o1 + 1))
        tokens = numpy.concatenate(parts).tolist()
        return tokens + [self.pad] * (self.s + 1 - len(tokens))


# ---- blending ----------------------------------------------------------------------------------

class Blended:
    def __init__(self, datasets, weights, size):
        if size is not None:
            weights = normalize(weights)
        self.datasets = datasets
        if size is None:
            size = int(sum(weights))
            total = size
            frac = [w / float(total) for w in weights]
            counts = [0] * len(datasets)
            unspent = set(range(len(datasets)))
            self.index, self.sample = [], []
            t = 0
            while unspent:
                x = max(float(t), 1.0)
                best, best_err = -1, -math.inf
                for j in sorted(unspent):
                    err = frac[j] * x - counts[j]
                    if err > best_err:
                        best, best_err = j, err
                self.index.append(best)
                self.sample.append(counts[best])
                counts[best] += 1
                if weights[best] - counts[best] == 0:
                    unspent.discard(best)
                t += 1
        else:
            counts = [0] * len(datasets)
            self.index, self.sample = [], []
            for t in range(size):
                x = max(float(t), 1.0)
                best, best_err = 0, weights[0] * x - counts[0]
                for j in range(1, len(datasets)):
                    err = weights[j] * x - counts[j]
                    if err > best_err:
                        best, best_err = j, err
                self.index.append(best)
                self.sample.append(counts[best])
                counts[best] += 1
        for j, ds in enumerate(datasets):
            if self.index.count(j) > len(ds):
                raise IndexError(f"oversamples dataset {j}")

    def __len__(self):
        return len(self.index)

    def window(self, idx):
        return self.datasets[self.index[idx]].window(self.sample[idx])


def blend_from_list(items):
    if len(items) % 2 == 1:
        return [p.strip() for p in items], None
    weights = []
    for w in items[0::2]:
        try:
            weights.append(float(w))
        except ValueError:
            return [p.strip() for p in items], None
    return [p.strip() for p in items[1::2]], weights


def sizes_per_dataset(weights, sizes, surplus=0.0):
    return [[int(math.ceil(math.ceil(n * w) * (1 + surplus))) for n in sizes] for w in weights]


# ---- the builder -------------------------------------------------------------------------------

def build(spec):
    s, seed, pad = spec["seq_length"], spec["seed"], spec.get("pad", -1)
    surplus = spec.get("surplus", 0.005)
    sizes = spec["sizes"]
    cache = {}

    def low(prefix):
        if prefix not in cache:
            cache[prefix] = Indexed(prefix)
        return cache[prefix]

    def mid_level(dataset, matrix, split_sizes):
        out = []
        for i in range(3):
            if matrix[i] is None:
                out.append(None)
            else:
                out.append(GPT(dataset, split_indices(matrix[i], dataset.numel()), split_sizes[i], s, seed, pad))
        return out

    def top_level(prefixes, weights, matrix, split_sizes, only=None):
        if weights is not None:
            weights = normalize(weights)
            target = sizes_per_dataset(weights, split_sizes)
            buffer = sizes_per_dataset(weights, split_sizes, surplus)
        else:
            buffer = [[None] * 3 for _ in prefixes]
        mids = [mid_level(low(p), matrix, buffer[k]) for k, p in enumerate(prefixes)]
        result = [None] * 3
        for i in range(3):
            if matrix[i] is None or (only is not None and i != only):
                continue
            datasets = [m[i] for m in mids]
            if weights is not None:
                result[i] = Blended(datasets, weights, sum(t[i] for t in target))
            else:
                lengths = [len(d) for d in datasets]
                size = min(split_sizes[i], sum(lengths)) if split_sizes[i] is not None else None
                result[i] = Blended(datasets, lengths, size)
        return result

    if spec.get("mock"):
        mock = Mock(spec["mock"]["vocab_size"], spec["mock"]["eod"])
        return mid_level(mock, split_matrix(parse_split("1,1,1")), sizes)
    if spec.get("data_path"):
        prefixes, weights = blend_from_list(spec["data_path"])
        matrix = split_matrix(parse_split(spec.get("split") or "969, 30, 1"))
        if len(prefixes) == 1 and weights is None:
            return mid_level(low(prefixes[0]), matrix, sizes)
        return top_level(prefixes, weights, matrix, sizes)
    result = [None] * 3
    for i, key in enumerate(["train_data_path", "valid_data_path", "test_data_path"]):
        if not spec.get(key):
            continue
        prefixes, weights = blend_from_list(spec[key])
        matrix = [None] * 3
        matrix[i] = (0.0, 1.0)
        split_sizes = [0] * 3
        split_sizes[i] = sizes[i]
        if len(prefixes) == 1:
            result[i] = mid_level(low(prefixes[0]), matrix, split_sizes)[i]
        else:
            result[i] = top_level(prefixes, weights, matrix, split_sizes, only=i)[i]
    return result


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    if isinstance(spec, list):
        print(json.dumps([run(s) for s in spec]))
    else:
        print(json.dumps(run(spec)))


def run(spec):
    if "split_ranges" in spec:
        out = []
        for text in spec["split_ranges"]["splits"]:
            matrix = split_matrix(parse_split(text))
            per_split = []
            for numel in spec["split_ranges"]["elements"]:
                row = []
                for bookend in matrix:
                    if bookend is None:
                        row.append(None)
                    else:
                        row.append([int(round(bookend[0] * float(numel))), int(round(bookend[1] * float(numel)))])
                per_split.append(row)
            out.append(per_split)
        return {"ranges": out}
    datasets = build(spec)
    limit = spec.get("windows", -1)
    out = {}
    for name, ds in zip(SPLITS, datasets):
        if ds is None:
            out[name] = None
            continue
        n = len(ds) if limit < 0 else min(limit, len(ds))
        out[name] = {"size": len(ds), "windows": [[int(t) for t in ds.window(i)] for i in range(n)]}
    return out


if __name__ == "__main__":
    main()
