"""Cross-check driver (run by run.sh): builds small datasets, runs Megatron-LM's own dataset code
(real_megatron.py) and our oracle (../megatron_gpt_indices.py) on the same specs, compares every window."""
import json, os, subprocess, sys
import numpy
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from indexed_writer import write
PY = sys.executable
D = os.path.join(os.environ["WORK"], "data"); os.makedirs(D, exist_ok=True)
def make(name, docs, lo, hi, seed, code=8):
    rng = numpy.random.RandomState(seed)
    documents = []
    for d in range(docs):
        n = int(rng.randint(lo, hi + 1))
        toks = [int((d * 7 + j * 13 + seed) % 4999) for j in range(n)]
        if n: toks[-1] = 4999
        documents.append([toks] if n else [])
    write(f"{D}/{name}", code, documents)
    return f"{D}/{name}"
a = make("a", 300, 0, 120, 1); b = make("b", 40, 50, 900, 2, 4); c = make("c", 120, 1, 60, 3); d = make("d", 25, 1, 3, 4)
cases = [
  {"data_path": [a], "split": "80,15,5", "sizes": [300, 40, 10]},
  {"data_path": [a], "split": "'80, 15, 5'", "sizes": [2700, 150, 60]},
  {"data_path": [a], "split": "80,15,5", "sizes": [2100, 100, 30]},
  {"data_path": [b], "split": "70,20,10", "sizes": [500, 100, 50], "seq_length": 64},
  {"data_path": [d], "split": "60,40,0", "sizes": [7, 3, 2]},
  {"data_path": ["0.5", a, "0.3", b, "0.2", c], "split": "90,8,2", "sizes": [800, 60, 20], "seed": 99},
  {"data_path": ["1.0", c], "split": "90,8,2", "sizes": [50, 9, 4]},
  {"data_path": [a, c], "split": "90,8,2", "sizes": [500, 30, 10]},
  {"data_path": ["0.999", a, "0.001", c], "split": "90,8,2", "sizes": [1500, 50, 10]},
  {"data_path": ["0.2", b, "0.8", d], "split": "1,0,0", "sizes": [400, 0, 0]},
  {"train_data_path": ["0.7", a, "0.3", b], "valid_data_path": [c], "test_data_path": [a, d], "sizes": [600, 40, 15]},
  {"mock": {"vocab_size": 50257, "eod": 50256}, "sizes": [200, 40, 8], "seq_length": 2048, "windows": 60},
  {"mock": {"vocab_size": 1000, "eod": 999}, "sizes": [200, 40, 8], "seq_length": 4096, "seed": 7, "windows": 60},
]
bad = 0
for k, spec in enumerate(cases):
    spec.setdefault("seq_length", 32); spec.setdefault("seed", 1234); spec.setdefault("windows", -1)
    path = f"{D}/spec{k}.json"; json.dump(spec, open(path, "w"))
    mine = subprocess.run([PY, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "megatron_gpt_indices.py"), path], capture_output=True, text=True, check=True).stdout
    real = subprocess.run([PY, os.path.join(os.path.dirname(os.path.abspath(__file__)), "real_megatron.py"), path], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.environ["WORK"] + "/pkg:" + os.environ["WORK"] + "/pylib"))
    if real.returncode != 0:
        print(k, "REAL FAILED", real.stderr[-800:]); bad += 1; continue
    m, r = json.loads(mine), json.loads(real.stdout)
    same = m == r
    sizes = {s: (m[s] or {}).get("size") for s in m}
    print(k, "same" if same else "DIFFERENT", sizes)
    bad += not same
print("mismatches:", bad)

# The writer: Megatron's IndexedDatasetBuilder (add_document, add_index) against ../indexed_writer.py
# (which the CI test compares byte for byte with megatrain's builder).
sys.path.insert(0, os.environ["WORK"] + "/pkg")
sys.path.insert(0, os.environ["WORK"] + "/pylib")
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder  # noqa: E402
docs = [[[5, 6, 7]], [], [[1], [2, 3], []], [[100, 101, 102, 103, 104]], [], [[9, 8]], [[65535, 0, 300]]]
writer_bad = 0
for code, dtype in [(8, numpy.uint16), (4, numpy.int32), (5, numpy.int64), (6, numpy.float64), (7, numpy.float32)]:
    write(f"{D}/py_{code}", code, docs)
    b = IndexedDatasetBuilder(f"{D}/mg_{code}.bin", dtype=dtype)
    for doc in docs:
        b.add_document([t for seq in doc for t in seq], [len(seq) for seq in doc])
    b.finalize(f"{D}/mg_{code}.idx")
    for ext in ("bin", "idx"):
        same = open(f"{D}/py_{code}.{ext}", "rb").read() == open(f"{D}/mg_{code}.{ext}", "rb").read()
        writer_bad += not same
        print(f"writer dtype {code} .{ext}:", "same" if same else "DIFFERENT")
write(f"{D}/py_first", 8, docs[:3]); write(f"{D}/py_rest", 8, docs[3:])
m = IndexedDatasetBuilder(f"{D}/mg_merged.bin", dtype=numpy.uint16)
m.add_index(f"{D}/py_first"); m.add_index(f"{D}/py_rest"); m.finalize(f"{D}/mg_merged.idx")
for ext in ("bin", "idx"):
    same = open(f"{D}/py_8.{ext}", "rb").read() == open(f"{D}/mg_merged.{ext}", "rb").read()
    writer_bad += not same
    print(f"add_index merge .{ext}:", "same" if same else "DIFFERENT")
print("writer mismatches:", writer_bad)
