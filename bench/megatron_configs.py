#!/usr/bin/env python3
"""Runs Megatron-LM's own training configurations through `megatrain --dry-run`.

Takes a Megatron-LM source tree and a megatrain binary. For every training config of the GPT,
MoE and Mixtral functional tests (tests/functional_tests/test_cases/{gpt,moe,mixtral}/*/
model_config.yaml, inference configs left out) and for the GPT-3, Llama-3, Mixtral and Megatron-FSDP example
launch scripts, it builds the command line as Megatron-LM's test runner would, replaces only the
data and tokenizer flags with `--mock-data --tokenizer-type NullTokenizer --vocab-size V` (with
--fim-data, which Megatron refuses on mock data: the small GPT-2-style dataset of tests/fixtures/fim),
points every path at a scratch folder, and runs `megatrain <flags> --dry-run --world-size N` (N: the
config's own GPUS_PER_NODE where its MODEL_ENV_VARS give one that the layout divides, else the
smallest multiple of TP x PP x CP, and of ETP x EP x PP, that is at least 8, the GPUs of one node).

Prints one line per config (PASS / FAIL and the problems named), then how many passed and which
problems stop how many configs. `--json FILE` writes the same as JSON; `--write-fixture FILE`
writes the passing command lines (scratch paths as @TMP@, the repository as @SRC@) for tests/cli_megatron_configs_test.cpp,
which keeps them passing.

  python3 bench/megatron_configs.py --megatron ~/Megatron-LM --megatrain build/app/megatrain

`--train N` goes further for the configurations that pass: each trains N iterations on the
reference backend, one MPI rank per GPU of its world size (`mpirun --oversubscribe`), with its
parallel layout, expert counts, routing, recompute, optimizer and checkpointing flags as written,
in float32 (--bf16 / --fp16 dropped: the reference backend's precision; with them the flags
Megatron-LM allows only in 16 bits), but shrunk widths (head dim 8, FFN 64, experts' FFN 32, the
multi-latent attention ranks 16), sequences of 64 tokens per context-parallel rank, vocabulary
512 (mock data), one layer per virtual stage where nothing fixes the layer count, one micro-batch
per pipeline stage (or the config's micro-batch group), an evaluation after the last iteration
and a checkpoint saved there where the config saves: what a user's script exercises of
megatrain's code, at a size two CPU cores train in seconds.
"""
import argparse
import math
import collections
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

import yaml

# Data and tokenizer flags: replaced by mock data and the null tokenizer. The value is the number
# of words the flag takes (None: everything up to the next flag).
DATA_FLAGS = {
    "--data-path": None, "--train-data-path": None, "--valid-data-path": None, "--test-data-path": None,
    "--tokenizer-type": 1, "--tokenizer-model": 1, "--vocab-file": 1, "--merge-file": 1,
    "--tiktoken-pattern": 1, "--mock-data": 0, "--vocab-size": 1, "--data-args-path": 1,
    "--per-split-data-args-path": 1, "--tokenizer-metadata": 1, "--legacy-tokenizer": 0,
    "--null-tokenizer-vocab-size": 1,
}
# Megatron refuses mock data with --fim-data ("Mock dataset is not supported with FIM dataset."), so
# configs with it read the small GPT-2-style dataset tests/fixtures/fim holds instead (@SRC@: the
# repository root, in the fixture too).
SRC = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIM_DATA = ["--data-path", "@SRC@/tests/fixtures/fim/text_document", "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", "@SRC@/tests/fixtures/fim/vocab.json", "--merge-file", "@SRC@/tests/fixtures/fim/merges.txt"]
EXAMPLES = [
    "examples/gpt3/train_gpt3_175b_distributed.sh",
    "examples/llama/train_llama3_8b_h100_fp8.sh",
    "examples/mixtral/train_mixtral_8x7b_distributed.sh",
    "examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh",
    "examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh",
    "examples/gptoss/02_train.sh",
]
# Examples run on other than the 8 GPUs of their script: gpt-oss's pipeline size is its world size
# (PP_SIZE=${WORLD_SIZE}), which must divide its 12 layers (Megatron-LM refuses 8).
EXAMPLE_GPUS = {"examples/gptoss/02_train.sh": 4}


def git_files(repo, pattern):
    out = subprocess.run(["git", "-C", repo, "ls-files"], capture_output=True, text=True)
    names = out.stdout.split() if out.returncode == 0 else [
        os.path.relpath(os.path.join(d, f), repo) for d, _, fs in os.walk(repo) for f in fs]
    return sorted(n for n in names if re.fullmatch(pattern, n))


# Variables Megatron-LM's functional-test harness sets that are not paths: REPEAT numbers the
# repetitions of a test (--seed ${REPEAT} in some configs).
HARNESS_VALUES = {"REPEAT": "1"}


def substitute(word, scratch, known=None):
    """A shell variable becomes its value where the script (or the functional-test harness) sets one
    that is not a path, else a folder under the scratch directory."""
    def value(m):
        name = m.group(1)
        v = (known or {}).get(name, HARNESS_VALUES.get(name))
        if v is not None and "$" in v and name not in v:  # another variable's value (PP_SIZE=${WORLD_SIZE})
            v = substitute(v, scratch, known)
            v = None if v.startswith(scratch) else v
        return v if v is not None and "/" not in v and "$" not in v else os.path.join(scratch, name.lower())
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)(?::-[^}]*)?\}?", value, word)


# Where the repository keeps distillation configs (ENV_VARS.DISTILL_CONFIG of Megatron-LM's
# modelopt_distill tests, and the CPU fixtures' own), block style.
KD_DIR = "tests/fixtures/megatron/kd"


def distill_config(words, kd, name, write):
    """Writes a functional test's DISTILL_CONFIG where its --export-kd-cfg points (as its BEFORE_SCRIPT
    does with yq) and returns the repository's copy (@SRC@/...): a file of KD_DIR holding the same
    config, else (with `write`) a new one named after the test; None when there is none."""
    if kd is None or "--export-kd-cfg" not in words:
        return None
    path = words[words.index("--export-kd-cfg") + 1]
    cfg = yaml.safe_load(kd)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        yaml.safe_dump(cfg, fh, default_flow_style=False, sort_keys=False)
    for f in sorted(os.listdir(os.path.join(SRC, KD_DIR))):
        if f.endswith(".yaml"):
            with open(os.path.join(SRC, KD_DIR, f)) as fh:
                if yaml.safe_load(fh) == cfg:
                    return f"@SRC@/{KD_DIR}/{f}"
    if not write:
        return None
    f = name.split("/")[-1] + ".yaml"
    with open(os.path.join(SRC, KD_DIR, f), "w") as fh:
        yaml.safe_dump(cfg, fh, default_flow_style=False, sort_keys=False)
    return f"@SRC@/{KD_DIR}/{f}"


def yaml_args(model_args, scratch):
    words = []
    for flag, value in model_args.items():
        if value is False or value is None:
            continue
        words.append(flag)
        if value is True:
            continue
        if isinstance(value, list):
            words += [substitute(str(v), scratch) for v in value]
        elif isinstance(value, str) and re.fullmatch(r"\[[^]]+\]", value.strip()):
            # Megatron-LM's harness (tests/functional_tests/shell_test_utils/_run_training.sh) strips
            # the brackets of a "[a b]" value and lets the shell split it into words; any other
            # value with spaces stays one quoted word.
            words += [substitute(v, scratch) for v in value.strip()[1:-1].split()]
        else:
            words.append(substitute(str(value), scratch))
    return words


def script_args(text, scratch, gpus=None):
    """The `--flag value` words of a launch script's argument arrays (`NAME_ARGS=( ... )`), shell-split,
    comments dropped, the launcher's own array (DISTRIBUTED_ARGS) and profiler arrays left out.
    Variables the script sets (`X=v`, `X=${X:-v}`, `X=$((A*B))` of integers) take that value."""
    known = {}
    for m in re.finditer(r"^\s*(?:export\s+)?([A-Z_][A-Z0-9_]*)=(?:\$\{\1:-([^}]*)\}|([^\s(]\S*))?\s*$", text, re.M):
        known[m.group(1)] = (m.group(2) if m.group(2) is not None else m.group(3) or "").strip('"')
    if gpus:
        known["GPUS_PER_NODE"] = str(gpus)
    for name, v in known.items():  # shell arithmetic on known integers (WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES)))
        m = re.fullmatch(r"\$\(\((.*)\)\)", v)
        if m:
            expr = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda g: known.get(g.group(1), "?"), m.group(1))
            if re.fullmatch(r"[0-9+*/ -]+", expr):
                known[name] = str(eval(expr.replace("/", "//")))
    words, array = [], None
    for line in text.splitlines():
        line = line.split(" #")[0].strip()
        m = re.match(r"([A-Za-z_][A-Za-z0-9_]*)=\(\s*(.*)$", line)
        if m:
            array, line = m.group(1), m.group(2)
        if array is None:
            continue
        closing = line.endswith(")")
        line = line.rstrip(")").rstrip("\\").strip()
        if array.endswith("ARGS") and array != "DISTRIBUTED_ARGS" and "PROFIL" not in array and line.startswith("--"):
            try:
                words += [substitute(p, scratch, known) for p in shlex.split(line)]
            except ValueError:
                pass
        if closing:
            array = None
    return words


def strip_flags(words, drop, replace=None):
    """words without the flags of `drop` (each with its number of value words; None: up to the next
    flag), and with the value of each flag of `replace` replaced."""
    out, i = [], 0
    while i < len(words):
        w = words[i]
        if w in drop:
            n = drop[w]
            i += 1
            if n is None:
                while i < len(words) and not words[i].startswith("--"):
                    i += 1
            else:
                i += n
            continue
        out.append(w)
        if replace and w in replace and i + 1 < len(words) and not words[i + 1].startswith("--"):
            out.append(replace[w])
            i += 2
            continue
        i += 1
    return out


def strip_data_flags(words):
    return strip_flags(words, DATA_FLAGS)


def flag_int(words, flag, default=1):
    for i, w in enumerate(words[:-1]):
        if w == flag:
            try:
                return int(words[i + 1])
            except ValueError:
                return default
    return default


def world_size(words, gpus=None):
    tp, pp = flag_int(words, "--tensor-model-parallel-size"), flag_int(words, "--pipeline-model-parallel-size")
    mp = tp * pp * flag_int(words, "--context-parallel-size")
    # MoE: the experts' grid needs the world divisible by ETP x EP x PP as well (Megatron's rule).
    expert = flag_int(words, "--expert-tensor-parallel-size", tp) * flag_int(words, "--expert-model-parallel-size") * pp
    mp = math.lcm(mp, expert)
    if isinstance(gpus, int) and gpus > 0 and gpus % mp == 0:
        return gpus
    return mp * max(1, -(-8 // mp))


def problems(stderr):
    lines = stderr.splitlines()
    out = []
    for i, line in enumerate(lines):
        if "problems with the command line:" in line:
            out += [l.strip() for l in lines[i + 1:] if l.startswith("  ")]
            break
        m = re.search(r"\] error: (.*)", line)
        if m:
            out.append(m.group(1).strip())
    return out or [stderr.strip().splitlines()[-1] if stderr.strip() else "exit without message"]


def problem_key(p):
    """What a problem is about: the flag it names, or its text without numbers."""
    m = re.search(r"(--[a-z0-9-]+)", p)
    kind = "unrecognized" if p.startswith("unrecognized") else "unsupported" if "does not support" in p else "invalid"
    return f"{m.group(1)} ({kind})" if m else re.sub(r"[0-9.]+", "N", p)[:100]


# --train: widths shrunk so that every config trains on CPU ranks in seconds; the flags that fix the
# structure (layers, experts, heads, parallel sizes, layouts) stay as written.
SHRINK = {
    "--ffn-hidden-size": "64", "--moe-ffn-hidden-size": "32", "--moe-shared-expert-intermediate-size": "32",
    "--kv-channels": "8", "--q-lora-rank": "16", "--kv-lora-rank": "16", "--qk-head-dim": "8",
    "--qk-pos-emb-head-dim": "4", "--v-head-dim": "8", "--vocab-size": "512", "--eval-iters": "1",
    "--log-interval": "1",
}
# Flags dropped with their values (the number of words after the flag; None: up to the next flag).
DROP = {"--rampup-batch-size": 3, "--step-batch-size-schedule": 1, "--global-batch-size": 1, "--train-iters": 1,
        "--train-samples": 1, "--eval-interval": 1, "--eval-global-batch-size": 1, "--exit-interval": 1,
        "--save-interval": 1, "--seq-length": 1, "--max-position-embeddings": 1, "--hidden-size": 1,
        "--decoder-seq-length": 1, "--exit-duration-in-mins": 1,
        # The reference backend computes in float32: the 16-bit formats are the GPU's (its tests), and
        # so is the overlap of the experts' all-to-all (with its delayed weight gradients), which
        # Megatron allows with them only.
        "--bf16": 0, "--fp16": 0, "--overlap-moe-expert-parallel-comm": 0, "--delay-wgrad-compute": 0}


def teacher_command(cmd):
    """For a distillation run (--export-kd-teacher-load DIR): the same command without the
    distillation flags, training one iteration and saving it into DIR (no --load); else None."""
    if "--export-kd-teacher-load" not in cmd:
        return None
    kd = {"--export-kd-teacher-load": 1, "--export-kd-cfg": 1, "--export-kd-teacher-model-config": 1,
          "--export-kd-teacher-ckpt-format": 1, "--load": 1, "--save": 1, "--save-interval": 1, "--train-iters": 1,
          "--train-samples": 1, "--exit-interval": 1}
    out, i = [], 0
    while i < len(cmd):
        if cmd[i] in kd:
            i += 1 + kd[cmd[i]]
            continue
        out.append(cmd[i])
        i += 1
    teacher = cmd[cmd.index("--export-kd-teacher-load") + 1]
    return out + ["--train-iters", "1", "--save", teacher, "--save-interval", "1"]


def shrink(words, ws, iters):
    """The config's words with shrunk widths and a short run (see --train)."""
    tp, pp = flag_int(words, "--tensor-model-parallel-size"), flag_int(words, "--pipeline-model-parallel-size")
    cp = flag_int(words, "--context-parallel-size")
    heads = flag_int(words, "--num-attention-heads", 8)
    mbs = flag_int(words, "--micro-batch-size", 1)
    dp = max(1, ws // (tp * pp * cp))
    # One micro-batch per stage (a whole 1F1B or interleaved schedule), or the interleaved
    # schedule's micro-batch group where a config sets a larger one.
    micro = max(pp, flag_int(words, "--microbatch-group-size-per-virtual-pipeline-stage", 1))
    gbs = mbs * dp * micro
    seq = 64 * cp
    # Fewer layers where nothing else fixes the count (a layout, first or last stage sizes, a
    # per-layer MoE pattern): one per virtual stage, or --recompute-num-layers of them.
    drop = dict(DROP)
    fixed = any(f in words for f in (
        "--pipeline-model-parallel-layout", "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
        "--num-layers-in-first-pipeline-stage", "--num-layers-in-last-pipeline-stage", "--hybrid-override-pattern"))
    freq = next((words[j + 1] for j, w in enumerate(words[:-1]) if w == "--moe-layer-freq"), "1")
    extra = []
    if not fixed and re.fullmatch(r"[0-9]+", freq):
        per_chunk = max(1, flag_int(words, "--recompute-num-layers", 1))
        chunks = flag_int(words, "--num-virtual-stages-per-pipeline-rank", 0)
        if "--num-layers-per-virtual-pipeline-stage" in words:
            per_stage = flag_int(words, "--num-layers-per-virtual-pipeline-stage")
            chunks = flag_int(words, "--num-layers", pp * per_stage) // (pp * per_stage)
        # (The embedding and the loss may count as layers in the pipeline split.)
        accounted = sum(f in words for f in ("--account-for-embedding-in-pipeline-split",
                                             "--account-for-loss-in-pipeline-split"))
        if pp * max(1, chunks) * per_chunk <= accounted:
            per_chunk *= 2
        if "--num-layers-per-virtual-pipeline-stage" in words:
            drop["--num-layers-per-virtual-pipeline-stage"] = 1
            extra += ["--num-layers-per-virtual-pipeline-stage", str(per_chunk)]
        drop["--num-layers"] = 1
        extra += ["--num-layers", str(pp * max(1, chunks) * per_chunk - accounted)]
    out = strip_flags(words, drop, SHRINK)
    head_dim = 8
    out += extra + ["--hidden-size", str(heads * head_dim), "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--global-batch-size", str(gbs), "--eval-interval", str(iters), "--device", "cpu"]
    # A schedule in samples (--train-samples with --lr-decay-samples ...) stays one in samples.
    if "--train-samples" in words or "--step-batch-size-schedule" in words:
        out += ["--train-samples", str(iters * gbs)]
    else:
        out += ["--train-iters", str(iters)]
    if "--fim-data" in words:  # (the small dataset of tests/fixtures/fim has no test split)
        out += ["--eval-iters", "0"]
    if "--save" in words:
        out += ["--save-interval", str(iters)]
    if "--eval-global-batch-size" in words:
        out += ["--eval-global-batch-size", str(gbs)]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron", required=True, help="Megatron-LM source tree")
    ap.add_argument("--megatrain", required=True, help="megatrain binary")
    ap.add_argument("--vocab-size", default="32000")
    ap.add_argument("--json", help="write the results here as JSON")
    ap.add_argument("--write-fixture", help="write the passing configurations' flags here, one per line")
    ap.add_argument("--megatron-commit", help="the Megatron-LM commit, for the fixture's header (default: git's)")
    ap.add_argument("--only", help="run only configs whose name contains this")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each config's command line")
    ap.add_argument("--train", type=int, default=0, metavar="N",
                    help="also train each passing config N iterations on CPU ranks at shrunk widths (see above)")
    ap.add_argument("--mpirun", default="mpirun", help="the MPI launcher for --train")
    ap.add_argument("--train-timeout", type=int, default=300, help="seconds per --train run")
    ap.add_argument("--train-max-ranks", type=int, default=0, help="--train only the configs of at most this many "
                    "ranks (0: all)")
    ap.add_argument("--write-train-fixture", help="write the configs that trained (NAME, ranks, megatrain's "
                    "flags) here, one per line, for tests/mpi/megatron_configs_train.cmake")
    a = ap.parse_args()

    configs = []
    for f in git_files(a.megatron, r"tests/functional_tests/test_cases/(gpt|moe|mixtral)/[^/]+/model_config\.yaml"):
        with open(os.path.join(a.megatron, f)) as fh:
            doc = yaml.safe_load(fh)
        if not isinstance(doc, dict) or str(doc.get("MODE", "pretraining")) != "pretraining" \
                or not isinstance(doc.get("MODEL_ARGS"), dict):
            continue
        # The GPUs the functional test runs its first training on (MODEL_ENV_VARS.MODEL_ARGS).
        env = doc.get("MODEL_ENV_VARS")
        gpus = env.get("MODEL_ARGS", {}).get("GPUS_PER_NODE") if isinstance(env, dict) and \
            isinstance(env.get("MODEL_ARGS"), dict) else None
        # The distillation tests' BEFORE_SCRIPT writes ENV_VARS.DISTILL_CONFIG (flow YAML) as the
        # --export-kd-cfg file; the sweep does the same (distill_config below).
        kd = doc.get("ENV_VARS", {}).get("DISTILL_CONFIG") if isinstance(doc.get("ENV_VARS"), dict) else None
        configs.append((f.split("/")[3] + "/" + f.split("/")[4], ("yaml", doc["MODEL_ARGS"]), gpus, kd))
    for f in EXAMPLES:
        path = os.path.join(a.megatron, f)
        if os.path.exists(path):
            with open(path) as fh:
                configs.append((f, ("script", fh.read()), EXAMPLE_GPUS.get(f), None))
    if a.only:
        configs = [c for c in configs if a.only in c[0]]

    results = []
    tally = collections.Counter()
    with tempfile.TemporaryDirectory() as scratch:
        for name, (kind, body), gpus, kd in configs:
            words = yaml_args(body, scratch) if kind == "yaml" else script_args(body, scratch, gpus)
            fixture_kd = distill_config(words, kd, name, bool(a.write_fixture))
            if "--fim-data" in words:
                words = strip_data_flags(words) + [w.replace("@SRC@", SRC) for w in FIM_DATA]
            else:
                words = strip_data_flags(words) + ["--mock-data", "--tokenizer-type", "NullTokenizer",
                                                   "--vocab-size", a.vocab_size]
            ws = world_size(words, gpus)
            cmd = [a.megatrain] + words + ["--dry-run", "--world-size", str(ws)]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            ok = r.returncode == 0
            probs = [] if ok else problems(r.stderr)
            for p in {problem_key(p) for p in probs}:
                tally[p] += 1
            args = [w.replace(scratch, "@TMP@").replace(SRC, "@SRC@") for w in cmd[1:]]
            if fixture_kd:  # (the repository's copy of the distillation config, for the fixture)
                args[args.index("--export-kd-cfg") + 1] = fixture_kd
            results.append({"config": name, "world_size": ws, "passed": ok, "problems": probs, "args": args})
            print(f"{'PASS' if ok else 'FAIL'} {name} (world size {ws})" + ("" if ok else ": " + " | ".join(probs)))
            if ok and a.train > 0 and (a.train_max_ranks <= 0 or ws <= a.train_max_ranks):
                run_dir = os.path.join(scratch, "train", re.sub(r"[^A-Za-z0-9_.-]", "_", name))
                os.makedirs(run_dir, exist_ok=True)
                twords = [w.replace(scratch, run_dir) for w in shrink(words, ws, a.train)]
                if fixture_kd:
                    twords[twords.index("--export-kd-cfg") + 1] = fixture_kd.replace("@SRC@", SRC)
                tcmd = [a.mpirun, "-np", str(ws), "--oversubscribe", a.megatrain] + twords
                t0 = time.monotonic()
                tenv = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                            OMPI_MCA_mpi_yield_when_idle="1")
                try:
                    # Distillation: a teacher of the student's own model first (one iteration, saved where
                    # --export-kd-teacher-load points), as tests/megatron_config_train.sh makes it.
                    teacher = teacher_command(tcmd)
                    if teacher:
                        subprocess.run(teacher, capture_output=True, text=True, timeout=a.train_timeout, env=tenv,
                                       check=True)
                    t = subprocess.run(tcmd, capture_output=True, text=True, timeout=a.train_timeout, env=tenv)
                    tok, terr = t.returncode == 0, t.stderr
                except subprocess.CalledProcessError as e:
                    tok, terr = False, "the distillation teacher's run failed: " + (e.stderr or "")
                except subprocess.TimeoutExpired:
                    tok, terr = False, f"timed out after {a.train_timeout} s"
                results[-1]["trained"] = tok
                results[-1]["train_args"] = [w.replace(run_dir, "@TMP@").replace(SRC, "@SRC@") for w in twords]
                if not tok:
                    results[-1]["train_problems"] = problems(terr) if terr else ["exit without message"]
                    tally["training: " + problem_key(results[-1]["train_problems"][0])] += 1
                results[-1]["train_seconds"] = round(time.monotonic() - t0, 1)
                print(f"  {'TRAINED' if tok else 'TRAIN FAIL'} {a.train} iterations ({results[-1]['train_seconds']} s)"
                      + ("" if tok else ": " + " | ".join(results[-1]["train_problems"][:3])))
                if a.verbose or not tok:
                    print("  " + shlex.join(tcmd[1:]))
            if a.verbose:
                print("  " + shlex.join(cmd[1:]))
    passed = sum(r["passed"] for r in results)
    print(f"\n{passed} of {len(results)} configurations pass the dry run")
    if a.train > 0:
        trained = sum(bool(r.get("trained")) for r in results)
        tried = sum("trained" in r for r in results)
        print(f"{trained} of the {tried} that pass (and have at most {a.train_max_ranks or 'any'} ranks) train "
              f"{a.train} iterations at shrunk widths on CPU ranks")
    print("problems, by how many configurations they stop:")
    for k, n in tally.most_common():
        print(f"  {n:4d}  {k}")
    megatron_commit = a.megatron_commit or subprocess.run(
        ["git", "-C", a.megatron, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() \
        or "unknown"
    def write(path, header, lines):
        with open(path, "w") as fh:
            fh.write(header + "".join(line + "\n" for line in lines))
    if a.write_fixture:
        write(a.write_fixture,
              f"# Megatron-LM training configurations that pass megatrain --dry-run ({passed} of {len(results)}\n"
              f"# at Megatron-LM {megatron_commit}), written by bench/megatron_configs.py --write-fixture:\n"
              "# NAME<TAB>the command line, shell-quoted, @TMP@ for a scratch directory, @SRC@ for the repository.\n",
              [r["config"] + "\t" + shlex.join(r["args"]) for r in results if r["passed"]])
    if a.write_train_fixture:
        write(a.write_train_fixture,
              f"# Megatron-LM training configurations (at Megatron-LM {megatron_commit}) that train {a.train} "
              "iterations at shrunk widths on CPU ranks,\n# written by bench/megatron_configs.py --train N "
              "--write-train-fixture: NAME<TAB>ranks<TAB>megatrain's flags, shell-quoted, @TMP@ for a scratch "
              "directory, @SRC@ for the repository.\n",
              [f"{r['config']}\t{r['world_size']}\t{shlex.join(r['train_args'])}" for r in results if r.get("trained")])
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"passed": passed, "total": len(results), "results": results,
                       "problems": tally.most_common()}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
