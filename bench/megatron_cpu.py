#!/usr/bin/env python3
"""Run Megatron-LM's own pretrain_gpt.py, unmodified, on a machine without a GPU.

    python bench/megatron_cpu.py MEGATRON_DIR <pretrain_gpt.py flags...>
    python -m torch.distributed.run --nproc_per_node N bench/megatron_cpu.py MEGATRON_DIR <flags...>

The script installs the CPU shims listed below, appends `--distributed-backend gloo` to the flags
(argparse keeps the last occurrence, so this overrides any other backend), sets sys.argv to
["pretrain_gpt.py", flags...] and executes MEGATRON_DIR/pretrain_gpt.py as `__main__`
(runpy.run_path), i.e. exactly what `python pretrain_gpt.py <flags>` runs: its argument parsing,
megatron.training.pretrain, the training loop, logging and checkpointing. Nothing of Megatron is
copied here and the Megatron tree is not written to (see "Side effects").

Numerics are not touched: no patch replaces or wraps any mathematical operation. Model, gradients
and optimizer run in the dtype the flags ask for (float32 with the fixture flags) through
Megatron's own code on CPU tensors; the patches only (a) redirect where tensors are allocated
(CUDA -> CPU), (b) stub GPU-runtime bookkeeping (streams, events, memory statistics,
synchronisation) that has no CPU counterpart, and (c) give Megatron's "CUDA" random-number
generator an implementation on the CPU. Collectives run on gloo.

Validated (Megatron-LM d98e8a6 / Megatron-Core 0.20, PyTorch 2.15 CPU build, 2 cores, gloo): the
dense llama fixture model (tests/fixtures/megatron/make_fixtures.sh) in 1 process, data-parallel 2
with the distributed optimizer, tensor-parallel 2 and pipeline-parallel 2; the "moe" fixture model
(make_moe_fixtures.sh) in 1 process, expert-parallel 2 with the alltoall dispatcher and
data-parallel 2 with global_aux_loss; torch_dist checkpoints saved with their optimizer state.
Finetuning 3 iterations from the GPU-made llama/tp1_dist checkpoint prints, in each of those
layouts, the lm loss and grad norm of the H100 run (llama/megatron_finetune_iterations.log) to the
printed digits (largest difference 1e-6 in lm loss); resuming the GPU-made llama/torch_tp2pp2
checkpoint (torch format, TP 2 x PP 2, non-distributed optimizer; --no-load-rng) in 4 processes
prints iterations 4-6 as the H100 log does (iteration 5 as the mean of iterations 4 and 5:
Megatron's training_log does not reset its loss sums after the first iteration a process logs,
so the second logged line of every run, fresh or resumed, averages the first two iterations; the
GPU log's iteration 5 was not a process's second). Not possible here, exactly as on a GPU
without Transformer Engine or Apex: resuming the distributed optimizer from a checkpoint
(torch_dist: DistributedOptimizer.state_dict asserts on the fresh torch.optim.Adam's missing
"step"; torch format: "a view of a leaf Variable that requires grad is being used in an in-place
operation" in _set_main_param_and_optimizer_states); both are in Megatron's own code paths and
independent of the device.

Random numbers. A GPU run has two generators: the CPU one (seeded by torch.manual_seed, used by
--use-cpu-initialization) and the CUDA one (device-side initialisation, dropout, and the states
of Megatron's CudaRNGStatesTracker). Without a GPU there is only the CPU generator, so Megatron's
CUDA generator and its tracker states are kept in the CPU default generator (patches 7-8): the
tracker's fork() swaps the CPU generator's state exactly as it swaps the CUDA one on a GPU, so
tensor-/expert-parallel ranks still initialise their shards from their own seeds. The CPU's
Mersenne-Twister cannot reproduce CUDA's Philox numbers, so a run that initialises on the device
(the default) starts from different weights than the same flags on a GPU, and its losses differ
from a GPU log from the first iteration on (by ~0.04 for the llama fixture model). To compare
with a GPU run, start both from the same checkpoint (--load ... --finetune, as validated above).
With --use-cpu-initialization every initial weight is drawn from the CPU generator on a GPU too,
and the CPU generator's sequence here is meant to be the GPU run's (patch 9 keeps the JIT
warm-up's draws out of it), so such a run should start from the GPU run's weights; that was not
checked against a GPU (no GPU run with that flag exists; the fixture logs are device-initialised).
A checkpoint made on a GPU holds a Philox state that a CPU generator cannot take: load it with
--no-load-rng (or --finetune); patch 7 stops with a message saying so.

Patches (all installed by this file, in this process, before pretrain_gpt.py runs; each rank of a
torch.distributed.run launch runs this file and installs them too):

 1. A torch.overrides.TorchFunctionMode, CudaDeviceToCpu, active for the whole run. Megatron
    allocates many tensors with a literal device='cuda' / device=torch.cuda.current_device() and
    moves batches and modules with .cuda(); without a GPU each of these raises. For every torch
    function call the mode rewrites a `device=` keyword that names a CUDA device (a "cuda..."
    string, a torch.device of type cuda, or a bare device index) to "cpu", and the device
    positional argument of Tensor.to likewise; Tensor.cuda(...) and Tensor.pin_memory() return
    the tensor itself (pinning needs an accelerator); Tensor.type() without arguments answers the
    CUDA type name ("torch.cuda.FloatTensor" for a CPU float32 tensor), because Megatron
    classifies parameters by that string (DistributedOptimizer._build_model_and_main_param_groups
    raises TypeError for anything but torch.cuda.{Float,Half,BFloat16}Tensor; clip_grads.py
    asserts torch.cuda.FloatTensor). Every other call, Tensor.type(some_type) included, runs with
    its arguments unchanged, so no computation differs. Sites rewritten in the validated runs
    (MEGATRON_CPU_TRACE=1 lists them): device='cuda' in training/initialize.py (JIT warm-up
    inputs), training/training.py (start timestamps, do_train flags, loss accumulators),
    training/checkpointing.py (read_metadata's iteration all-reduce), core/optimizer/optimizer.py
    and clip_grads.py (found-inf / scale / norm scalars), core/utils.py (grad-norm all-reduce),
    core/rerun_state_machine.py, core/pipeline_parallel/schedules.py (total_num_tokens);
    .cuda() in pretrain_gpt.py (get_batch) and training/models/dist_utils.py (model to GPU);
    .type() in core/optimizer/distrib_optimizer.py and clip_grads.py.
 2. torch.cuda.current_device -> "cpu": its value is used as a device (device=..., .to(...),
    .cuda(...)) throughout Megatron-Core (router buffers, DDP grad buffers, ...); "cpu" makes
    those CPU tensors directly.
 3. torch.cuda.device_count -> 1 and torch.cuda.set_device -> no-op: initialize.
    _initialize_distributed only calls mpu.initialize_model_parallel (all process groups) and
    _set_random_seed only sets up the RNG tracker (model_parallel_cuda_manual_seed) when
    device_count() > 0; set_device(local_rank) then selects the (absent) GPU.
    torch.cuda.is_available is NOT patched (it stays False, so import-time probes behave as on a
    CPU machine); instead:
 4. megatron.training.training.initialize_megatron is wrapped to pass allow_no_cuda=True, the
    parameter Megatron provides to skip its `assert torch.cuda.is_available()`; nothing else in
    initialize_megatron depends on it.
 5. torch.cuda.synchronize, torch.cuda.empty_cache -> no-ops; torch.cuda.memory_allocated,
    max_memory_allocated, memory_reserved, max_memory_reserved -> 0 (the memory report after the
    first iterations prints zeros); torch.cuda.Stream / Event / current_stream / default_stream /
    stream(...) -> inert stand-ins (every method a no-op returning another stand-in, so that
    stream.record_event().synchronize() works; stream() a null context); torch.cuda.nvtx.range_push
    / range_pop / range -> no-ops. Used by the timers, the torch_dist writer, DDP's gradient-sync
    stream (dist_utils.py, param_and_grad_buffer.py) and the alltoall dispatcher's device-to-host
    stream. On the CPU every operation is synchronous, so there is nothing to wait for or record;
    gloo's async collectives are still waited on by Megatron through their work handles.
 6. megatron.core.datasets.utils.compile_helpers: Megatron compiles its dataset index helpers
    (helpers.cpp, pybind11) with `make` inside its own tree. The replacement runs Megatron's same
    Makefile (make -f MEGATRON_DIR/megatron/core/datasets/Makefile, SRC = that helpers.cpp) in a
    build directory outside the tree ($MEGATRON_CPU_CACHE/helpers, default
    /tmp/megatron_cpu_cache/helpers), with pybind11's include flags and extension suffix taken
    from this Python (the Makefile asks `python3`, which may be another interpreter), and
    megatron.core.datasets.__path__ gets that directory so `from megatron.core.datasets import
    helpers_cpp` finds the module. Needs pybind11 (pip install pybind11) and a C++ compiler.
 7. The CUDA generator on the CPU: torch.cuda.get_rng_state / torch.cuda.random.get_rng_state ->
    torch.get_rng_state(); torch.cuda.set_rng_state / torch.cuda.random.set_rng_state ->
    torch.set_rng_state() (refusing, with a message naming --no-load-rng, a state that is not a
    CPU generator state, e.g. a GPU checkpoint's Philox state); torch.cuda.manual_seed(s) ->
    torch.default_generator.manual_seed(s). Used by CudaRNGStatesTracker.add, by
    model_parallel_cuda_manual_seed (which re-seeds the "CUDA" generator with the seed
    torch.manual_seed just used, leaving the CPU state as it was) and by checkpointing's
    get_rng_state / load (the checkpoint's cuda_rng_state is the CPU state).
 8. megatron.core.tensor_parallel.random._get_cuda_rng_state / _set_cuda_rng_state -> get / set
    the CPU default generator's state (graph_safe, for CUDA graphs, is refused). Megatron's
    versions go through torch.cuda.default_generators and torch.cuda._lazy_call, which, with CUDA
    never initialised, queues the state change instead of applying it: the tracker's fork()
    would not switch states and add() would leave the generator re-seeded.
    The tracker's fork() logs "CPU RNG state changed within GPU RNG context" when the CPU state
    changed inside a fork, which here is by design (the forked state IS the CPU state): a
    logging filter drops exactly that message from the logger megatron.core.tensor_parallel.random.
 9. megatron.training.initialize._warmup_jit_function runs under
    torch.random.fork_rng(devices=[]) (CPU generator state restored afterwards). On a GPU its
    torch.rand(device="cuda") inputs and its dropout draw from the CUDA generator only; here they
    would advance the CPU generator and shift every later CPU draw (--use-cpu-initialization
    weights) against the GPU run's. The warm-up's own numbers are thrown away by Megatron.
10. megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu (and the name imported into
    token_dispatcher): the alltoall dispatcher copies its split sizes and token counts to the host
    (as NumPy arrays for the split sizes, which all_to_all_single needs as lists) only
    `if tensor.is_cuda`; CPU tensors were passed through as tensors, and all_to_all_single then
    rejected them. The replacement does the same copy (tensor.to("cpu", copy=True), .numpy() when
    as_numpy) without the is_cuda test; record_stream has nothing to record.
11. megatron.training.arguments.get_device_arch_version -> 9: validate_args asks the GPU's compute
    capability (torch.cuda.get_device_properties) when tensor or context parallelism is on; 9
    (Hopper, the GPUs the fixtures were made on) takes the pre-Blackwell branch, which only
    requires CUDA_DEVICE_MAX_CONNECTIONS=1 (set here).
12. megatron.core.dist_checkpointing.strategies.torch.TorchDistLoadShardedStrategy.
    load_tensors_metadata (the checkpoint's tensor list, read for --dist-ckpt-strictness other than
    assume_ok_unexpected): Megatron passes each stored tensor's TensorProperties to torch.empty as
    keywords, and this PyTorch's properties carry `strides`, which torch.empty does not take. The
    replacement drops that one key (the tensors it makes are empty "meta" placeholders).
13. megatron.core.transformer.torch_norm.WrappedTorchNorm (the local spec's norms without Apex)
    refuses sequence parallelism. Under SP the replacement builds the same torch norm from a copy
    of the config without it and marks the norm's parameters `sequence_parallel`, as Megatron's
    own FusedLayerNorm does (fused_layer_norm.py), so that finalize_model_grads sums their
    gradients over TP. A norm is per token: SP changes which rows a rank normalizes, not how.
14. megatron.core.tensor_parallel.inference_layers.is_inference_column_parallel_linear (and the
    name imported into multi_token_prediction): it asks isinstance() of the inference-optimized
    linear classes, which without Transformer Engine are not classes, so building an MTP layer
    raised TypeError. Without Transformer Engine no module is such a linear: the replacement
    answers False there and asks the original otherwise.

15. Megatron-FSDP (--use-megatron-fsdp) builds its device meshes with device_type="cuda"
    (torch.distributed.device_mesh.DeviceMesh and DeviceMesh.from_group; mcore_fsdp_adapter.py):
    on the CPU those meshes are made with device_type "cpu", over the same gloo groups.
16. Megatron-FSDP names its device torch.device(f"cuda:{torch.cuda.current_device()}")
    (megatron_fsdp.py, mcore_fsdp_adapter.py, param_and_grad_buffer.py, utils.py), which patch 2
    turns into "cuda:cpu". Those modules see a `torch` whose device() gives the CPU device for
    any "cuda..." string (every other attribute is torch's own); FullyShardedDataParallel is
    handed device=cpu where the caller gives none. Megatron-FSDP's gradient reduce-scatter
    divides with ReduceOp.PREMUL_SUM, which gloo lacks: pass --no-gradient-reduce-div-fusion (the
    same division done after the reduction), and CUDA_DEVICE_MAX_CONNECTIONS must be > 1 (the
    environment's value wins over this file's default; Megatron-FSDP asks for it).
17. Saving --ckpt-format fsdp_dtensor in float32 with --swiglu: Megatron-LM's
    handle_swiglu_in_state_dict (fsdp_dtensor_checkpoint.py) looks linear_fc1 up as
    model.get_parameter("module." + key), one wrapper level deeper than a float32 model has (bf16
    and fp16 models have Float16Module there). The lookup retries without the extra "module."
    (the same parameter, found by its own path); nothing it saves changes. Without this a float32
    SwiGLU model cannot save that format (by the code, on a GPU too; not run on one).
Megatron-FSDP was run this way on one process (dense and MoE models, saving and resuming
fsdp_dtensor checkpoints) and on two at tensor parallel 2; two data-parallel processes hang in its
save's and load's collectives (uneven_dtensor.py's chunk metadata on one rank while the other
still splits SwiGLU halves), which was not pursued.
18. ModelOpt's layer spec (megatron/core/post_training/modelopt: the model of every
    --export-kd-teacher-load run, student and teacher) builds its norms with modelopt.layers.Norm,
    which raises ImportError without Transformer Engine: without it Norm builds the local spec's
    WrappedTorchNorm (the same torch RMSNorm/LayerNorm, parameter `weight` as TE's), so patch 13 applies.
19. That spec's core attention is TEDotProductAttention unless --export-force-local-attention; without
    Transformer Engine it is the local DotProductAttention (what the flag selects), the same softmax(QK^T)V.
Environment set here (setdefault, so an explicit value wins): CUDA_DEVICE_MAX_CONNECTIONS=1
(Megatron asks for it with tensor/sequence parallelism), and for a single process without a
launcher RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, MASTER_ADDR=127.0.0.1, MASTER_PORT = a free port.
PYTHONDONTWRITEBYTECODE=1 (and sys.dont_write_bytecode) so that neither this process nor the
processes Megatron spawns (the torch_dist writer's multiprocessing manager re-imports
pretrain_gpt.py) write __pycache__ into the Megatron tree.

Side effects outside the Megatron tree: the helpers build directory (patch 6), torch.compile's
cache (Megatron's jit_fuser is torch.compile; inductor compiles its fused SwiGLU / bias-dropout-add
for the CPU under /tmp/torchinductor_$USER), and whatever --save / --tensorboard-dir name.

MEGATRON_CPU_TRACE=1 prints, once per call site, every Megatron line where patch 1 rewrote a
device or answered Tensor.type(), and every patched torch.cuda function that was called.
"""
import contextlib
import logging
import os
import socket
import sys
import traceback

sys.dont_write_bytecode = True

_TRACE = os.environ.get("MEGATRON_CPU_TRACE") == "1"
_seen = set()


def _note(kind):
    """MEGATRON_CPU_TRACE=1: print the first non-torch caller of a patched call, once per site."""
    if not _TRACE:
        return
    for fr in reversed(traceback.extract_stack()[:-2]):
        if fr.filename == __file__ or os.sep + "torch" + os.sep in fr.filename or fr.filename.startswith("<"):
            continue
        key = (kind, fr.filename, fr.lineno)
        if key not in _seen:
            _seen.add(key)
            print(f"[megatron_cpu] {kind}: {fr.filename}:{fr.lineno}: {fr.line}", file=sys.stderr, flush=True)
        return


def _is_cuda_device(d):
    import torch

    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, int) and not isinstance(d, bool)  # a bare index means a CUDA device


def _install_device_mode():
    """Patch 1 (see the module docstring)."""
    import torch
    from torch.overrides import TorchFunctionMode

    tensor_to, tensor_cuda, tensor_type, tensor_pin = (
        torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.type, torch.Tensor.pin_memory)

    class CudaDeviceToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is tensor_cuda:
                _note("Tensor.cuda -> self")
                return args[0]
            if func is tensor_pin:
                _note("Tensor.pin_memory -> self")
                return args[0]
            if func is tensor_type and len(args) == 1 and not kwargs:
                name = func(*args)
                if not name.startswith("torch.cuda."):
                    _note("Tensor.type() -> torch.cuda.*")
                    name = "torch.cuda." + name[len("torch."):]
                return name
            if "device" in kwargs and _is_cuda_device(kwargs["device"]):
                _note(f"device=cuda -> cpu in {getattr(func, '__name__', func)}")
                kwargs = dict(kwargs, device="cpu")
            if func is tensor_to and len(args) > 1 and _is_cuda_device(args[1]):
                _note("Tensor.to(cuda) -> cpu")
                args = (args[0], "cpu") + tuple(args[2:])
            return func(*args, **kwargs)

    mode = CudaDeviceToCpu()
    mode.__enter__()  # stays active until the process exits
    return mode


class _Inert:
    """Stand-in for torch.cuda.Stream / Event objects: every method is a no-op that returns another
    stand-in (Stream.record_event() gives an Event whose synchronize() does nothing)."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: _Inert()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _traced(name, fn):
    if not _TRACE:
        return fn

    def wrapper(*args, **kwargs):
        _note(f"torch.cuda.{name}")
        return fn(*args, **kwargs)

    return wrapper


def _set_cpu_rng_state(state):
    import torch

    if not isinstance(state, torch.Tensor) or state.numel() != torch.get_rng_state().numel():
        raise RuntimeError(
            "megatron_cpu: a CUDA generator state (e.g. the RNG state of a checkpoint saved on a GPU) "
            "cannot be set on the CPU generator that stands in for it here; load such checkpoints "
            "with --no-load-rng (or --finetune)")
    torch.set_rng_state(state)


def _patch_torch_cuda():
    """Patches 2, 3, 5, 7 and 15."""
    import torch
    from torch.distributed import device_mesh

    # 15: Megatron-FSDP's "cuda" device meshes, on the CPU.
    mesh_init = device_mesh.DeviceMesh.__init__
    mesh_from_group = device_mesh.DeviceMesh.from_group

    def __init__(self, device_type, *args, **kwargs):
        return mesh_init(self, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    def from_group(*args, **kwargs):
        if kwargs.get("device_type") == "cuda":
            kwargs["device_type"] = "cpu"
        return mesh_from_group(*("cpu" if a == "cuda" else a for a in args), **kwargs)

    device_mesh.DeviceMesh.__init__ = __init__
    device_mesh.DeviceMesh.from_group = staticmethod(from_group)

    c = torch.cuda
    patches = {
        "current_device": lambda: "cpu",
        "device_count": lambda: 1,
        "set_device": lambda *a, **k: None,
        "synchronize": lambda *a, **k: None,
        "empty_cache": lambda *a, **k: None,
        "memory_allocated": lambda *a, **k: 0,
        "max_memory_allocated": lambda *a, **k: 0,
        "memory_reserved": lambda *a, **k: 0,
        "max_memory_reserved": lambda *a, **k: 0,
        "current_stream": lambda *a, **k: _Inert(),
        "default_stream": lambda *a, **k: _Inert(),
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "get_rng_state": lambda *a, **k: torch.get_rng_state(),
        "set_rng_state": lambda state, *a, **k: _set_cpu_rng_state(state),
        "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)),
    }
    for name, fn in patches.items():
        setattr(c, name, _traced(name, fn))
    c.Stream = _Inert
    c.Event = _Inert
    c.random.get_rng_state = c.get_rng_state
    c.random.set_rng_state = c.set_rng_state
    c.nvtx.range_push = _traced("nvtx.range_push", lambda *a, **k: None)
    c.nvtx.range_pop = _traced("nvtx.range_pop", lambda *a, **k: None)
    c.nvtx.range = _traced("nvtx.range", lambda *a, **k: contextlib.nullcontext())


class _DropForkRngWarning(logging.Filter):
    def filter(self, record):
        return record.getMessage() != "CPU RNG state changed within GPU RNG context"


def patch_torch_norm_for_sequence_parallel():
    """Patch 13 (also used by tests/fixtures/megatron/make_moe_cpu_fixtures.py): WrappedTorchNorm
    under sequence parallelism builds the norm from a copy of the config without it and marks the
    norm's parameters `sequence_parallel`, as Megatron's own norms (FusedLayerNorm, TENorm) do."""
    import copy

    from megatron.core.transformer import torch_norm

    wrapped_new = torch_norm.WrappedTorchNorm.__new__

    def torch_norm_new(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return wrapped_new(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        instance = wrapped_new(cls, plain, *args, **kwargs)
        for p in instance.parameters():
            setattr(p, "sequence_parallel", True)
        return instance

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(torch_norm_new)


def _patch_megatron(megatron_dir):
    """Patches 4, 6, 8-14 and 16-19 (Megatron modules are imported here, after patches 1-3, 5, 7, 15)."""
    import subprocess

    import torch
    import sysconfig

    import torch

    # 8: the tracker's CUDA-state accessors, on the CPU generator.
    from megatron.core.tensor_parallel import random as mrandom

    def _get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
        assert not graph_safe, "megatron_cpu: CUDA-graph-safe RNG states need a GPU"
        _note("random._get_cuda_rng_state")
        return torch.get_rng_state()

    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        assert not graph_safe, "megatron_cpu: CUDA-graph-safe RNG states need a GPU"
        _note("random._set_cuda_rng_state")
        _set_cpu_rng_state(new_state)

    mrandom._get_cuda_rng_state = _get_cuda_rng_state
    mrandom._set_cuda_rng_state = _set_cuda_rng_state
    logging.getLogger(mrandom.__name__).addFilter(_DropForkRngWarning())

    # 6: dataset helpers built outside the Megatron tree.
    import megatron.core.datasets as datasets_pkg
    from megatron.core.datasets import utils as datasets_utils

    src_dir = os.path.join(megatron_dir, "megatron", "core", "datasets")
    build_dir = os.path.join(os.environ.get("MEGATRON_CPU_CACHE", "/tmp/megatron_cpu_cache"), "helpers")
    os.makedirs(build_dir, exist_ok=True)
    datasets_pkg.__path__.append(build_dir)

    def compile_helpers():
        includes = subprocess.run([sys.executable, "-m", "pybind11", "--includes"], check=True,
                                  capture_output=True, text=True).stdout.strip()
        cmd = ["make", "-C", build_dir, "-f", os.path.join(src_dir, "Makefile"),
               "SRC=" + os.path.join(src_dir, "helpers.cpp"), "CPPFLAGS=" + includes,
               "LIBEXT=" + sysconfig.get_config_var("EXT_SUFFIX")]
        if subprocess.run(cmd).returncode != 0:
            sys.exit("megatron_cpu: building Megatron's dataset helpers failed (pybind11 and g++ needed)")

    datasets_utils.compile_helpers = compile_helpers

    # 9: the JIT warm-up's random inputs must not advance the CPU generator.
    from megatron.training import initialize

    warmup = initialize._warmup_jit_function

    def _warmup_jit_function(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return warmup(*args, **kwargs)

    initialize._warmup_jit_function = _warmup_jit_function

    # 10: the alltoall dispatcher's device-to-host copies of its split sizes.
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor):
            _note("moe maybe_move_tensor_to_cpu")
            tensor = tensor.to("cpu", copy=True)
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    # 11: the GPU generation validate_args asks about (tensor / context parallelism).
    from megatron.training import arguments

    def get_device_arch_version():
        _note("get_device_arch_version")
        return 9

    arguments.get_device_arch_version = get_device_arch_version

    # 12: stored tensors' properties without `strides` when Megatron lists a checkpoint's tensors.
    from megatron.core.dist_checkpointing.strategies import torch as dist_torch

    empty = torch.empty

    def load_tensors_metadata(self, checkpoint_dir, metadata=None):
        def empty_without_strides(*args, **kwargs):
            kwargs.pop("strides", None)
            return empty(*args, **kwargs)

        dist_torch.torch.empty = empty_without_strides
        try:
            return original_load_tensors_metadata(self, checkpoint_dir, metadata)
        finally:
            dist_torch.torch.empty = empty

    original_load_tensors_metadata = dist_torch.TorchDistLoadShardedStrategy.load_tensors_metadata
    dist_torch.TorchDistLoadShardedStrategy.load_tensors_metadata = load_tensors_metadata

    # 13: the torch norms under sequence parallelism.
    patch_torch_norm_for_sequence_parallel()

    # 14: without Transformer Engine no module is an inference-optimized linear.
    from megatron.core.tensor_parallel import inference_layers
    from megatron.core.transformer import multi_token_prediction

    is_inference_linear = inference_layers.is_inference_column_parallel_linear

    def is_inference_column_parallel_linear(module):
        return inference_layers.HAVE_TE and is_inference_linear(module)

    inference_layers.is_inference_column_parallel_linear = is_inference_column_parallel_linear
    multi_token_prediction.is_inference_column_parallel_linear = is_inference_column_parallel_linear

    # 16: Megatron-FSDP's "cuda:<current device>" devices, on the CPU.
    import importlib

    class _TorchCpuDevices:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def device(*args, **kwargs):
            if args and isinstance(args[0], str) and args[0].startswith("cuda"):
                _note("megatron_fsdp torch.device")
                return torch.device("cpu")
            return torch.device(*args, **kwargs)

    fsdp = "megatron.core.distributed.fsdp."
    for name in ("src.megatron_fsdp.megatron_fsdp", "src.megatron_fsdp.param_and_grad_buffer",
                 "src.megatron_fsdp.utils", "mcore_fsdp_adapter"):
        importlib.import_module(fsdp + name).torch = _TorchCpuDevices()
    adapter = importlib.import_module(fsdp + "mcore_fsdp_adapter")
    for cls in (adapter.FullyShardedDataParallelV1, adapter.FullyShardedDataParallelV2):
        def with_cpu_device(init):
            def __init__(self, config, ddp_config, module, fsdp_unit_modules=None, disable_bucketing=False,
                         device=None, *args, **kwargs):
                return init(self, config, ddp_config, module, fsdp_unit_modules, disable_bucketing,
                            device or torch.device("cpu"), *args, **kwargs)
            return __init__
        cls.__init__ = with_cpu_device(cls.__init__)

    # 17: the float32 SwiGLU lookup of Megatron-LM's fsdp_dtensor save, one "module." up.
    from megatron.core.transformer import fsdp_dtensor_checkpoint
    from megatron.training import checkpointing

    handle_swiglu = fsdp_dtensor_checkpoint.handle_swiglu_in_state_dict

    def handle_swiglu_in_state_dict(model, model_state_dict, optimizer_state_dict):
        get_parameter = model.get_parameter

        def get_parameter_one_level_up(name):
            try:
                return get_parameter(name)
            except AttributeError:
                _note("fsdp_dtensor swiglu lookup one level up")
                return get_parameter(name[len("module."):])

        model.get_parameter = get_parameter_one_level_up
        try:
            return handle_swiglu(model, model_state_dict, optimizer_state_dict)
        finally:
            del model.get_parameter

    fsdp_dtensor_checkpoint.handle_swiglu_in_state_dict = handle_swiglu_in_state_dict
    checkpointing.handle_swiglu_in_state_dict = handle_swiglu_in_state_dict

    # 18: ModelOpt's spec norms (modelopt.layers.Norm, TE only) as the local spec's torch norms.
    from megatron.core.post_training.modelopt import layers as modelopt_layers
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if not modelopt_layers.HAVE_TE:
        def modelopt_norm_new(cls, config, hidden_size, eps=1e-5):
            _note("modelopt Norm -> WrappedTorchNorm")
            return WrappedTorchNorm(config, hidden_size, eps)

        modelopt_layers.Norm.__new__ = staticmethod(modelopt_norm_new)

    # 19: ModelOpt's spec attention without Transformer Engine: the local DotProductAttention.
    from megatron.core.post_training.modelopt.gpt import model_specs as modelopt_gpt_specs
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if not modelopt_layers.HAVE_TE:
        modelopt_gpt_specs.TEDotProductAttention = DotProductAttention

    # 4: skip initialize_megatron's CUDA assertion with its own parameter.
    from megatron.training import training

    initialize_megatron = training.initialize_megatron

    def initialize_megatron_no_cuda(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    training.initialize_megatron = initialize_megatron_no_cuda


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def main():
    if len(sys.argv) < 2 or not os.path.isfile(os.path.join(sys.argv[1], "pretrain_gpt.py")):
        sys.exit(__doc__.split("\n\n")[1] + "\nMEGATRON_DIR must hold pretrain_gpt.py")
    megatron_dir = os.path.abspath(sys.argv[1])
    flags = sys.argv[2:]

    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if "RANK" not in os.environ:  # not under torch.distributed.run: one process
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", _free_port())
    sys.path.insert(0, megatron_dir)

    _patch_torch_cuda()
    _install_device_mode()
    _patch_megatron(megatron_dir)

    import runpy

    sys.argv = ["pretrain_gpt.py"] + flags + ["--distributed-backend", "gloo"]
    runpy.run_path(os.path.join(megatron_dir, "pretrain_gpt.py"), run_name="__main__")


if __name__ == "__main__":
    main()
