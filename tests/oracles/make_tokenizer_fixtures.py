#!/usr/bin/env python3
"""Token-id oracle for megatrain's tokenizers, with the reference libraries (Hugging Face
`tokenizers`, `sentencepiece`).

  make_tokenizer_fixtures.py fixtures DATA_DIR OUT_DIR
      Writes OUT_DIR/texts.json and OUT_DIR/<name>.json (the expected ids of each text) for the
      tokenizers in DATA_DIR (the shared test data: gpt2/, llama3/, llama2/). Run it to refresh tests/fixtures/tokenizers/:
      .venv/bin/python tests/oracles/make_tokenizer_fixtures.py fixtures ../shared/data tests/fixtures/tokenizers
  make_tokenizer_fixtures.py ids SPEC.json
      Prints {"ids": [[...], ...], "vocab_size": V} for the texts of SPEC with the tokenizer it
      names (the live comparison of tests/tokenizer_test.cpp).
  make_tokenizer_fixtures.py pretokenize SPEC.json
      Prints {"pieces": [[...], ...]}: the Split pre-tokenizer of SPEC["regex"] on each text.
  make_tokenizer_fixtures.py unicode
      Prints the code points of Oniguruma's \\p{L}, \\p{N}, \\s (as tokenizers evaluates them) as ranges.

Megatron's ids are what its classes return (megatron/core/tokenizers, HEAD):
  GPT2BPETokenizer -> transformers GPT2TokenizerFast(vocab, merges)(text).input_ids, i.e. byte-level
      BPE with "<|endoftext|>" a special added token (built here directly with `tokenizers`);
  HuggingFaceTokenizer -> AutoTokenizer(dir)(text).input_ids = tokenizer.json's encode(text) with
      its post-processor (add_special_tokens=True);
  SentencePiece types -> SentencePieceProcessor.encode_as_ids(text).
"""
import glob
import json
import os
import sys
import tempfile

SPEC_TEXTS = [
    "Hello world",
    "",
    " ",
    "  \n\n\t ",
    "\t\t\n \r\n\r\n  x",
    "it's THEY'LL we'Re you'VE I'm he'D she's 'ſ 'S isn't",
    "digits 1 12 123 1234 12345678901234567890 3.14159 1,000,000",
    "emoji 😀👍🏽🧑‍🚀 flags 🇫🇷 CJK 中文字符 日本語のテキスト 한국어",
    "combining e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937 Zalgo z\u0351\u0352\u0357",
    "<|endoftext|>x<|endoftext|> <|endoftext|>  <|endoftext|>\n",
    "<|begin_of_text|>hi<|end_of_text|><|eot_id|> <|reserved_special_token_5|>",
    "<s> hello </s> <unk>",
    "a  b   c\n\n  d\r\ne\rf",
    "\u3000x\u00a0y\u2028z\u2029w\u0085v\u000bu\u000ct\u1680s\u202fr\u205fq",
    "naïve café résumé Ærøskøbing straße İstanbul",
    "(parens) [brackets] {braces} \"quotes\" 'single' `back` --dashes-- ...dots... !!!",
    "https://example.com/a/very/long/url/with?query=string&and=more#fragment_and_more_text_here",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "=" * 100 + " " + "-" * 70 + "_" * 65,
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/ABCDEFGHIJKLMNOPQRSTUVWXYZabcdef",
    "tab\tseparated\tvalues\n\tindented\n    spaces",
    "\x00\x01\x07\x1b\x7f control chars",
    "mixed Ελληνικά русский עברית العربية हिन्दी ไทย",
    "  leading and trailing  ",
    "\n",
    "x\n",
    "'",
    "' s",
]


def pod_sample(limit):
    text = ""
    for f in sorted(glob.glob("/usr/share/perl/5.*/pod/*.pod")):
        text += open(f, encoding="utf-8", errors="replace").read()
        if len(text) >= limit:
            break
    return text[:limit]


def gpt2_tokenizer(vocab, merges):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.BPE.from_file(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    return tok


def encode_all(spec, texts):
    kind = spec["kind"]
    if kind == "sp":
        import sentencepiece as spm
        sp = spm.SentencePieceProcessor()
        sp.Load(spec["model"])
        return [sp.encode_as_ids(t) for t in texts], sp.get_piece_size()
    from tokenizers import Tokenizer
    if kind == "gpt2":
        tok = gpt2_tokenizer(spec["vocab"], spec["merges"])
    else:
        path = spec["path"]
        tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path)
    add_special = spec.get("add_special_tokens", True)
    ids = [e.ids for e in tok.encode_batch(texts, add_special_tokens=add_special)]
    return ids, tok.get_vocab_size(with_added_tokens=True)


def decode_all(spec, ids_list):
    from tokenizers import Tokenizer
    if spec["kind"] == "gpt2":
        tok = gpt2_tokenizer(spec["vocab"], spec["merges"])
    else:
        path = spec["path"]
        tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path)
    return [tok.decode(ids, skip_special_tokens=False) for ids in ids_list]


def llama3_with_bos(src_dir, dst_dir):
    """Meta's released Llama 3 tokenizer.json: the same model with a TemplateProcessing
    post-processor that puts <|begin_of_text|> first (the shared copy has ByteLevel only)."""
    j = json.load(open(os.path.join(src_dir, "tokenizer.json"), encoding="utf-8"))
    bos = "<|begin_of_text|>"
    j["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {bos: {"id": bos, "ids": [128000], "tokens": [bos]}}}]}
    os.makedirs(dst_dir, exist_ok=True)
    json.dump(j, open(os.path.join(dst_dir, "tokenizer.json"), "w", encoding="utf-8"), ensure_ascii=False)


def llama2_metaspace(src_dir, dst_dir, scheme, split):
    """The Llama 2 model with a Metaspace pre-tokenizer and decoder instead of the Prepend/Replace
    normalizer (how newer conversions of SentencePiece models are written)."""
    j = json.load(open(os.path.join(src_dir, "tokenizer.json"), encoding="utf-8"))
    j["normalizer"] = None
    j["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": scheme, "split": split}
    j["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": scheme, "split": split},
        {"type": "ByteFallback"}, {"type": "Fuse"}]}
    os.makedirs(dst_dir, exist_ok=True)
    json.dump(j, open(os.path.join(dst_dir, "tokenizer.json"), "w", encoding="utf-8"), ensure_ascii=False)


def fixtures(data_dir, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    # Pod paragraphs keep the fixture files small but cover real English text.
    paragraphs = [p for p in pod_sample(20000).split("\n\n") if p.strip()]
    texts = SPEC_TEXTS + paragraphs
    with open(os.path.join(out_dir, "texts.json"), "w", encoding="utf-8") as f:
        json.dump(texts, f, ensure_ascii=True, indent=0)
        f.write("\n")
    with tempfile.TemporaryDirectory() as tmp:
        llama3_with_bos(os.path.join(data_dir, "llama3"), os.path.join(tmp, "llama3_bos"))
        llama2_metaspace(os.path.join(data_dir, "llama2"), os.path.join(tmp, "llama2_ms_first"), "first", False)
        llama2_metaspace(os.path.join(data_dir, "llama2"), os.path.join(tmp, "llama2_ms_split"), "always", True)
        specs = {
            "gpt2": {"kind": "gpt2", "vocab": os.path.join(data_dir, "gpt2/gpt2-vocab.json"),
                     "merges": os.path.join(data_dir, "gpt2/gpt2-merges.txt")},
            "llama3": {"kind": "hf", "path": os.path.join(data_dir, "llama3")},
            "llama3_bos": {"kind": "hf", "path": os.path.join(tmp, "llama3_bos")},
            "llama2": {"kind": "hf", "path": os.path.join(data_dir, "llama2")},
            "llama2_ms_first": {"kind": "hf", "path": os.path.join(tmp, "llama2_ms_first")},
            "llama2_ms_split": {"kind": "hf", "path": os.path.join(tmp, "llama2_ms_split")},
        }
        for name, spec in specs.items():
            ids, vocab_size = encode_all(spec, texts)
            out = {"tokenizer": name, "vocab_size": vocab_size, "ids": ids}
            with open(os.path.join(out_dir, name + ".json"), "w", encoding="utf-8") as f:
                json.dump(out, f, ensure_ascii=True, separators=(",", ":"))
                f.write("\n")
            print(f"{name}: {len(texts)} texts, {sum(map(len, ids))} tokens", file=sys.stderr)


def unicode_ranges():
    from tokenizers import Regex, pre_tokenizers
    cps = [c for c in range(0x110000) if not (0xD800 <= c <= 0xDFFF)]
    s = "".join(chr(c) for c in cps)
    out = {}
    for name, cls in (("L", r"\p{L}"), ("N", r"\p{N}"), ("S", r"\s")):
        # Removing the class leaves the non-members as pieces.
        pieces = pre_tokenizers.Split(Regex(cls), behavior="removed").pre_tokenize_str(s)
        non = set()
        for p, _ in pieces:
            non.update(ord(ch) for ch in p)
        members = sorted(set(cps) - non)
        ranges = []
        for c in members:
            if ranges and ranges[-1][1] == c - 1:
                ranges[-1][1] = c
            else:
                ranges.append([c, c])
        out[name] = ranges
    return out


def main():
    mode = sys.argv[1]
    if mode == "fixtures":
        fixtures(sys.argv[2], sys.argv[3])
    elif mode == "ids":
        spec = json.load(open(sys.argv[2], encoding="utf-8"))
        ids, vocab_size = encode_all(spec, spec["texts"])
        result = {"ids": ids, "vocab_size": vocab_size}
        if spec.get("decode"):
            result["decoded"] = decode_all(spec, spec["decode"])
        json.dump(result, sys.stdout)
    elif mode == "pretokenize":
        from tokenizers import Regex, pre_tokenizers
        spec = json.load(open(sys.argv[2], encoding="utf-8"))
        pt = pre_tokenizers.Split(Regex(spec["regex"]), behavior="isolated")
        json.dump({"pieces": [[p for p, _ in pt.pre_tokenize_str(t)] for t in spec["texts"]]}, sys.stdout)
    elif mode == "unicode":
        json.dump(unicode_ranges(), sys.stdout)
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
