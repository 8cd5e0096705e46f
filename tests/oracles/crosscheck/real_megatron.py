# Runs Megatron-LM's own dataset code (torch stubbed out, helpers.cpp compiled) on an oracle spec and
# prints the windows in the format of ../megatron_gpt_indices.py. Used by run.sh only.
import json, sys, tempfile
from collections import OrderedDict
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.utils import get_blend_from_list

class Tok:
    def __init__(self, vocab_size, eod):
        self.vocab_size, self.eod = vocab_size, eod
        self.unique_identifiers = OrderedDict(cls="fake")
    @property
    def pad(self): raise NotImplementedError
    @property
    def special_tokens_dict(self): raise AttributeError

spec = json.load(open(sys.argv[1]))
mock = spec.get("mock")
tok = Tok(mock["vocab_size"], mock["eod"]) if mock else Tok(50257, 4999)
blend_per_split = None
if any(spec.get(k) for k in ["train_data_path", "valid_data_path", "test_data_path"]):
    blend_per_split = [get_blend_from_list(spec.get(k)) for k in ["train_data_path", "valid_data_path", "test_data_path"]]
cfg = GPTDatasetConfig(
    random_seed=spec["seed"], sequence_length=spec["seq_length"],
    blend=get_blend_from_list(spec.get("data_path")) if spec.get("data_path") else None,
    blend_per_split=blend_per_split,
    split=(spec.get("split") or "969, 30, 1") if spec.get("data_path") else None,
    path_to_cache=tempfile.mkdtemp(), tokenizer=tok, reset_position_ids=False, reset_attention_mask=False,
    eod_mask_loss=False, mid_level_dataset_surplus=spec.get("surplus", 0.005))
cls = MockGPTDataset if mock else GPTDataset
datasets = BlendedMegatronDatasetBuilder(cls, spec["sizes"], lambda: True, cfg).build()
limit = spec.get("windows", -1)
out = {}
for name, ds in zip(["train", "valid", "test"], datasets):
    if ds is None:
        out[name] = None; continue
    def window(i):
        if isinstance(ds, BlendedDataset):
            return ds.datasets[ds.dataset_index[i]]._query_document_sample_shuffle_indices(ds.dataset_sample_index[i])[0]
        return ds._query_document_sample_shuffle_indices(i)[0]
    n = len(ds) if limit < 0 else min(limit, len(ds))
    out[name] = {"size": len(ds), "windows": [[int(t) for t in window(i)] for i in range(n)]}
print(json.dumps(out))
