"""Manual cross-check (not part of CI): Megatron-LM's own GPTFIMDataset code, its imports stubbed
(nothing of it is copied here: the file is loaded from the checkout), with transformers' GPT-2
tokenizer, against tests/oracles/megatron_fim.py on the same random samples, four FIM settings,
two vocabularies. Needs a Python with numpy, tokenizers and transformers.
  fim_real_megatron.py MEGATRON_DIR GPT2_DIR [SMALL_DIR]
GPT2_DIR / SMALL_DIR: folders holding vocab.json and merges.txt (SMALL_DIR: megatron_fim.py vocab DIR).
"""
import dataclasses
import importlib.util
import os
import random
import sys
import types

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import megatron_fim  # noqa: E402
from transformers import GPT2TokenizerFast

for name in ['megatron', 'megatron.core', 'megatron.core.datasets', 'megatron.core.datasets.gpt_dataset',
             'megatron.core.datasets.indexed_dataset', 'megatron.core.datasets.utils']:
    sys.modules[name] = types.ModuleType(name)
@dataclasses.dataclass
class GPTDatasetConfig:
    pass
class GPTDataset:
    pass
sys.modules['megatron.core.datasets.gpt_dataset'].GPTDataset = GPTDataset
sys.modules['megatron.core.datasets.gpt_dataset'].GPTDatasetConfig = GPTDatasetConfig
sys.modules['megatron.core.datasets.indexed_dataset'].IndexedDataset = object
sys.modules['megatron.core.datasets.utils'].Split = object
spec = importlib.util.spec_from_file_location('fim_dataset', os.path.join(sys.argv[1], 'megatron/training/datasets/fim_dataset.py'))
fd = importlib.util.module_from_spec(spec); spec.loader.exec_module(fd)

class HFWrap:  # the three methods of Megatron's HuggingFaceTokenizer that FIM uses (include_special_tokens=True)
    def __init__(self, t): self.tokenizer = t
    def tokens_to_ids(self, tokens): return self.tokenizer.convert_tokens_to_ids(tokens)
    def text_to_ids(self, text): return self.tokenizer(text).input_ids
    def ids_to_text(self, ids, remove_special_tokens=None):
        toks = self.tokenizer.convert_ids_to_tokens(ids)
        toks = [t for t in toks if t is not None and (not remove_special_tokens or t not in self.tokenizer.all_special_tokens)]
        return self.tokenizer.convert_tokens_to_string(toks)

def real(dirname, samples, seed, rate, spm, frag, split, nopre, names):
    t = GPT2TokenizerFast.from_pretrained(dirname)
    tk = types.SimpleNamespace(_tokenizer=HFWrap(t))
    ds = fd.GPTFIMDataset.__new__(fd.GPTFIMDataset)
    ds.config = types.SimpleNamespace(tokenizer=tk)
    ds.np_rng = np.random.RandomState(seed=seed)
    ds.fim_rate, ds.fim_spm_rate, ds.fragment_fim_rate, ds.no_fim_prefix = rate, spm, frag, nopre
    ds.fim_split_sample = t.convert_tokens_to_ids(split) if split else None
    (ds.prefix_tok_id, ds.middle_tok_id, ds.suffix_tok_id, ds.pad_tok_id, ds.eod_tok_id) = t.convert_tokens_to_ids(names)
    arrs = [np.array(s, dtype=np.uint16) for s in samples]
    ds.dataset = types.SimpleNamespace(get=lambda d, offset=0, length=None: arrs[d][offset:offset + length])
    ds.shuffle_index = np.zeros(len(arrs), dtype=np.int64); ds.document_index = np.arange(len(arrs))
    out = []
    for i in range(len(arrs)):
        ds.sample_index = np.array([(i, 0), (i, len(arrs[i]) - 1)])  # sample i: all of "document" i
        out.append(ds._query_document_sample_shuffle_indices(i)[0].tolist())
    return out

def mine(dirname, samples, seed, rate, spm, frag, split, nopre, names):
    f = megatron_fim.Fim({"vocab": dirname + "/vocab.json", "merges": dirname + "/merges.txt", "rate": rate,
                          "spm_rate": spm, "fragment_rate": frag, "split_sample": split, "no_prefix": nopre,
                          "tokens": dict(zip(["prefix", "middle", "suffix", "pad", "eod"], names))})
    rng = np.random.RandomState(seed=seed)
    return [f.sample(s, rng) for s in samples]

words = ["the", " code", " in", " café", " 中文", " a", " merge", "de", " fi", ",", " x", "\n", " or", " 😀", " er", "<|endoftext|>", " def"]
bad = 0
for dirname in sys.argv[2:]:
    t = GPT2TokenizerFast.from_pretrained(dirname)
    eot = t.convert_tokens_to_ids('<|endoftext|>'); lone = t.convert_tokens_to_ids('ä')
    r = random.Random(5)
    samples = []
    for k in range(300):
        ids = []
        while len(ids) < 41:
            d = t(''.join(r.choice(words) for _ in range(r.randrange(0, 12)))).input_ids
            if d and r.random() < 0.25: d.insert(r.randrange(len(d)), lone)
            ids += d + [eot] + ([eot] if r.random() < 0.1 else [])
        samples.append(ids[:41])
    for case in [(0.5, 0.5, None, None, None, ['<fim_prefix>', '<fim_middle>', '<fim_suffix>', '<fim_pad>', '<|endoftext|>']),
                 (1.0, 0.1, None, None, None, ['<fim_prefix>', '<fim_middle>', '<fim_suffix>', '<fim_pad>', '<|endoftext|>']),
                 (0.8, 0.5, 0.6, ',', ' a', ['<fim_prefix>', '<fim_middle>', '<fim_suffix>', '<fim_pad>', '<|endoftext|>']),
                 (0.7, 0.9, None, None, None, ['<PRE>', '<fim_middle>', '<fim_suffix>', '<fim_pad>', '<|endoftext|>'])]:
        a = real(dirname, samples, 1234, *case)
        b = mine(dirname, samples, 1234, *case)
        changed = sum(x != s for x, s in zip(a, samples))
        bad += a != b
        print(dirname, case[:5], 'equal' if a == b else 'DIFFERENT', 'changed', changed, 'of', len(samples))
sys.exit(1 if bad else 0)
