"""Oracle writer for the Megatron indexed dataset format (.bin/.idx "MMIDIDX", version 1), written
from the format description (Megatron-LM's megatron/core/datasets/indexed_dataset.py) with numpy.

Usage: indexed_writer.py SPEC.json
SPEC: {"prefix": str, "dtype": code, "documents": [[[token, ...], ...], ...]}, or a list of them
Each document is a list of sequences; an empty list is an empty document.
"""
import json
import struct
import sys

import numpy

DTYPES = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32, 5: numpy.int64,
          6: numpy.float64, 7: numpy.float32, 8: numpy.uint16}


def write(prefix, code, documents):
    dtype = DTYPES[code]
    itemsize = numpy.dtype(dtype).itemsize
    lengths, doc_indices = [], [0]
    with open(prefix + ".bin", "wb") as bin_file:
        for doc in documents:
            for seq in doc:
                bin_file.write(numpy.array(seq, dtype=dtype).tobytes(order="C"))
                lengths.append(len(seq))
            doc_indices.append(len(lengths))
    pointers = numpy.concatenate([[0], numpy.cumsum(numpy.array(lengths, dtype=numpy.int64) * itemsize)[:-1]]) \
        if lengths else numpy.zeros(0, dtype=numpy.int64)
    with open(prefix + ".idx", "wb") as idx:
        idx.write(b"MMIDIDX\x00\x00")
        idx.write(struct.pack("<Q", 1))
        idx.write(struct.pack("<B", code))
        idx.write(struct.pack("<Q", len(lengths)))
        idx.write(struct.pack("<Q", len(doc_indices)))
        idx.write(numpy.array(lengths, dtype=numpy.int32).tobytes(order="C"))
        idx.write(numpy.array(pointers, dtype=numpy.int64).tobytes(order="C"))
        idx.write(numpy.array(doc_indices, dtype=numpy.int64).tobytes(order="C"))


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        specs = json.load(f)
    for spec in specs if isinstance(specs, list) else [specs]:
        write(spec["prefix"], spec["dtype"], spec["documents"])
