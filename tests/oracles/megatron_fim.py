"""Oracle for data/fim: Megatron-LM's fill-in-the-middle samples (GPTFIMDataset,
megatron/training/datasets/fim_dataset.py), re-implemented from its published algorithm with
numpy's own RandomState and the Hugging Face `tokenizers` library standing in for Megatron's
GPT2BPETokenizer (GPT2TokenizerFast: byte-level BPE, "<|endoftext|>" special and unknown token).

Usage:
  megatron_fim.py vocab DIR      writes a small GPT-2-style vocab.json and merges.txt into DIR
  megatron_fim.py SPEC.json      prints the transformed samples as JSON (a list of lists)

SPEC: {"vocab": path, "merges": path, "seed": int, "rate": float, "spm_rate": float,
       "fragment_rate": float or null, "split_sample": str or null, "no_prefix": str or null,
       "tokens": {"prefix": str, "middle": str, "suffix": str, "pad": str, "eod": str},
       "samples": [[int, ...], ...],   the raw samples in the order they are read
       "streams": [int, ...]}          which reader (DataLoader worker) reads each sample
"""
import json
import os
import sys

import numpy
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

EOT = "<|endoftext|>"


def byte_alphabet():
    """GPT-2's printable stand-in for each byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def write_vocab(folder):
    """256 byte tokens, a few merges (ASCII words, a space prefix, two-byte UTF-8 pieces), FIM
    tokens as ordinary entries, "<|endoftext|>" last."""
    a = byte_alphabet()
    vocab = {a[b]: b for b in range(256)}
    merges = []

    def merge(x, y):
        merges.append((x, y))
        if x + y not in vocab:
            vocab[x + y] = len(vocab)

    sp = a[ord(" ")]
    for x, y in [(sp, "t"), ("h", "e"), (sp + "t", "he"), ("i", "n"), (sp, "a"), ("o", "r"), (sp, "in"),
                 ("e", "r"), (a[0xC3], a[0xA9]), (sp, "c"), ("o", "d"), ("od", "e"), (sp + "c", "ode"),
                 (a[0xE4], a[0xB8]), ("d", "e"), ("f", "i"), (sp, "m")]:
        merge(x, y)
    for t in ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]:
        vocab[t] = len(vocab)
    vocab[EOT] = len(vocab)
    with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for x, y in merges:
            f.write(f"{x} {y}\n")


class Gpt2:
    """What Megatron's FIM dataset calls on its tokenizer, with GPT2TokenizerFast's semantics."""

    def __init__(self, vocab, merges):
        self.tok = Tokenizer(models.BPE.from_file(vocab, merges))
        self.tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.tok.decoder = decoders.ByteLevel()
        self.tok.add_special_tokens([AddedToken(EOT, special=True)])
        self.special = {EOT}
        self.unk = self.tok.token_to_id(EOT)

    def token_id(self, token):  # convert_tokens_to_ids
        i = self.tok.token_to_id(token)
        return self.unk if i is None else i

    def text(self, ids):  # ids_to_text(ids, remove_special_tokens=True)
        tokens = [self.tok.id_to_token(int(i)) for i in ids]
        return self.tok.decoder.decode([t for t in tokens if t is not None and t not in self.special])

    def ids(self, text):  # text_to_ids
        return self.tok.encode(text).ids


class Fim:
    def __init__(self, spec):
        self.t = Gpt2(spec["vocab"], spec["merges"])
        names = spec["tokens"]
        self.prefix, self.middle, self.suffix, self.pad, self.eod = (
            self.t.token_id(names[k]) for k in ("prefix", "middle", "suffix", "pad", "eod"))
        self.rate, self.spm_rate = spec["rate"], spec["spm_rate"]
        self.fragment_rate = spec.get("fragment_rate")
        self.split = self.t.token_id(spec["split_sample"]) if spec.get("split_sample") else None
        self.no_prefix = spec.get("no_prefix")

    def fim_one(self, seq, rate, rng):
        """One segment: with probability rate, cut its text at two random characters and reorder."""
        if not rng.binomial(1, rate):
            return list(seq)
        text = self.t.text(seq)
        if self.no_prefix is not None and text.startswith(self.no_prefix):
            return list(seq)
        lo, hi = sorted(rng.randint(low=0, high=len(text) + 1, size=2))
        p, m, s = (self.t.ids(x) for x in (text[:lo], text[lo:hi], text[hi:]))
        if rng.binomial(1, self.spm_rate):
            return [self.prefix, self.suffix] + s + [self.middle] + p + m
        return [self.prefix] + p + [self.suffix] + s + [self.middle] + m

    @staticmethod
    def pieces(seq, sep):
        """The runs between separators: (run, followed_by_separator) for the non-empty runs
        before each separator, then the (possibly empty) rest."""
        out, cur = [], []
        for x in seq:
            if x == sep:
                if cur:
                    out.append((cur, True))
                cur = []
            else:
                cur.append(x)
        out.append((cur, False))
        return out

    def fim_segment(self, seq, rng):
        if self.split is None or self.split not in seq:
            return self.fim_one(seq, self.rate, rng)
        if not rng.binomial(1, self.rate):
            return list(seq)
        out = []
        for run, sep in self.pieces(seq, self.split):
            out += self.fim_one(run, self.fragment_rate, rng) + ([self.split] if sep else [])
        return out

    def sample(self, sample, rng):
        sample = [int(x) for x in sample]
        if self.eod in sample:
            out = []
            for run, sep in self.pieces(sample, self.eod):
                out += self.fim_segment(run, rng) + ([self.eod] if sep else [])
        else:
            out = self.fim_segment(sample, rng)
        n = len(sample)
        return out[:n] + [self.pad] * max(0, n - len(out))


def main(argv):
    if argv[0] == "vocab":
        write_vocab(argv[1])
        return
    with open(argv[0]) as f:
        spec = json.load(f)
    fim = Fim(spec)
    rngs = {}
    out = []
    for sample, stream in zip(spec["samples"], spec["streams"]):
        rng = rngs.setdefault(stream, numpy.random.RandomState(seed=spec["seed"]))
        out.append(fim.sample(sample, rng))
    print(json.dumps({"samples": out, "ids": [fim.prefix, fim.middle, fim.suffix, fim.pad, fim.eod]}))


if __name__ == "__main__":
    main(sys.argv[1:])
