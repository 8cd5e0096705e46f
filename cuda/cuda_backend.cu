// CudaBackend: set-up (device, stream, cuBLASLt, scratch), memory and transfers, and the
// dispatch of every op to its kernel family. See cuda_backend.h.
#include "cuda/cuda_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>

#include "core/log.h"
#include "cuda/attention.h"
#include "cuda/cuda_backend_dispatch.h"
#include "cuda/cuda_check.h"

namespace mt {

using cuda_dispatch::on_device;

void* cuda::Scratch::take(size_t bytes, const char* what) {
  const size_t start = (used_ + 255) & ~size_t{255};
  if (start + bytes > bytes_)
    fail("{}: needs {} bytes of scratch, {} of {} left (the CUDA backend's scratch is sized at construction)", what,
         bytes, bytes_ - std::min(bytes_, start), bytes_);
  used_ = start + bytes;
  return base_ + start;
}

CudaBackend::CudaBackend(int device_ordinal, size_t scratch_bytes) : device_(device_ordinal) {
  int count = 0;
  MT_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (device_ordinal < 0 || device_ordinal >= count)
    fail("CUDA device {} requested but {} device(s) visible (check CUDA_VISIBLE_DEVICES and LOCAL_RANK)",
         device_ordinal, count);
  MT_CUDA_CHECK(cudaSetDevice(device_));
  MT_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device_));
  MT_CUDA_CHECK(cudaFree(nullptr));  // create the context now, so the baseline below includes it
  {
    size_t free_bytes = 0, total_bytes = 0;
    MT_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    baseline_in_use_ = total_bytes - free_bytes;
  }
  // The compute and communication streams at the highest priority, the side stream
  // (begin_side_ops) at the lowest: where blocks of both wait for an SM, the compute stream's go first.
  MT_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lowest_priority_, &highest_priority_));
  MT_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, highest_priority_));
  MT_CUDA_CHECK(cudaStreamCreateWithPriority(&comm_stream_, cudaStreamNonBlocking, highest_priority_));
  MT_CUDA_CHECK(cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming));
  MT_CUDA_CHECK(cudaEventCreateWithFlags(&comm_done_, cudaEventDisableTiming));
  MT_CUDA_CHECK(cudaStreamCreateWithPriority(&tp_comm_stream_, cudaStreamNonBlocking, highest_priority_));
  MT_CUDA_CHECK(cudaEventCreateWithFlags(&tp_compute_done_, cudaEventDisableTiming));
  MT_CUDA_CHECK(cudaEventCreateWithFlags(&tp_comm_done_, cudaEventDisableTiming));
  scratch_memory_ = device_alloc(scratch_bytes);
  scratch_ = cuda::Scratch(scratch_memory_, scratch_bytes);
  gemm_ = std::make_unique<cuda::GemmRunner>(stream_, kGemmWorkspaceBytes);
  bytes_allocated_ += kGemmWorkspaceBytes;  // (the runner's own cudaMalloc)
  profiler_ = std::make_unique<cuda::OpProfiler>(stream_);
}

CudaBackend::~CudaBackend() {
  // Destructors must not throw: errors here are ignored (the process is usually ending).
  try {
    const std::string profile = profiler_ ? profiler_->report() : std::string();
    if (!profile.empty()) std::fputs(profile.c_str(), stderr);
  } catch (...) {
  }
  profiler_.reset();
  cudaStreamSynchronize(stream_);
  if (comm_stream_) cudaStreamSynchronize(comm_stream_);
  if (tp_comm_stream_) cudaStreamSynchronize(tp_comm_stream_);
  if (side_stream_) cudaStreamSynchronize(side_stream_);
  if (offload_stream_) cudaStreamSynchronize(offload_stream_);
  gemm_.reset();
  fp8_gemm_.reset();
  if (fp8_scale_slots_) cudaFree(fp8_scale_slots_);
  for (cudaEvent_t e : comm_marks_) cudaEventDestroy(e);
  for (cudaEvent_t e : time_marks_) cudaEventDestroy(e);
  for (cudaEvent_t e : side_marks_) cudaEventDestroy(e);
  if (side_start_) cudaEventDestroy(side_start_);
  if (side_done_) cudaEventDestroy(side_done_);
  if (side_stream_) cudaStreamDestroy(side_stream_);
  for (cudaEvent_t e : offload_marks_) cudaEventDestroy(e);
  if (offload_start_) cudaEventDestroy(offload_start_);
  if (offload_stream_) cudaStreamDestroy(offload_stream_);
  if (compute_done_) cudaEventDestroy(compute_done_);
  if (comm_done_) cudaEventDestroy(comm_done_);
  if (tp_compute_done_) cudaEventDestroy(tp_compute_done_);
  if (tp_comm_done_) cudaEventDestroy(tp_comm_done_);
  if (tp_comm_stream_) cudaStreamDestroy(tp_comm_stream_);
  if (comm_stream_) cudaStreamDestroy(comm_stream_);
  for (auto& r : registered_segments_) cudaFree(r.device);
  if (attention_workspace_) cudaFree(attention_workspace_);
  if (block_qkv_) cudaFree(block_qkv_);
  if (block_dqkv_) cudaFree(block_dqkv_);
  if (block_doc_) cudaFree(block_doc_);
  if (scratch_memory_) cudaFree(scratch_memory_);
  if (stream_) cudaStreamDestroy(stream_);
}

namespace {
// Grows a set of numbered marks to at least n events (made at set-up: a step creates none).
void reserve_events(std::vector<cudaEvent_t>& events, int n, unsigned flags) {
  while (static_cast<int>(events.size()) < n) {
    cudaEvent_t e = nullptr;
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&e, flags));
    events.push_back(e);
  }
}
}  // namespace

cuda::KernelContext CudaBackend::context() {
  scratch_.reset();
  // Side ops take no scratch (a compute op may reuse it while they run): an empty one fails by name.
  static cuda::Scratch no_scratch;
  if (side_ops_ && side_stream_) return cuda::KernelContext{side_stream_, num_sms_, &no_scratch, true};
  return cuda::KernelContext{stream_, num_sms_, &scratch_};
}

// ---- memory and transfers -------------------------------------------------------------------------
void* CudaBackend::allocate(size_t bytes) {
  void* p = device_alloc(bytes);
  if (p) block_bytes_[p] = bytes;
  return p;
}

void* CudaBackend::device_alloc(size_t bytes) {
  void* p = nullptr;
  if (bytes == 0) return nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err != cudaSuccess) {
    size_t free_bytes = 0, total = 0;
    cudaGetLastError();
    cudaMemGetInfo(&free_bytes, &total);
    fail("out of GPU memory on device {}: allocating {:.1f} MiB with {:.1f} MiB free of {:.1f} MiB; reduce "
         "--micro-batch-size or the model size, recompute more (--recompute-granularity selective "
         "--recompute-modules core_attn layernorm, or --recompute-granularity full), or add parallelism "
         "(--dry-run shows each GPU's plan)",
         device_, bytes / 1048576.0, free_bytes / 1048576.0, total / 1048576.0);
  }
  bytes_allocated_ += bytes;
  return p;
}

size_t CudaBackend::memory_in_use() const {
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return 0;
  const size_t used = total_bytes - free_bytes;
  return used > baseline_in_use_ ? used - baseline_in_use_ : 0;
}

void CudaBackend::deallocate(void* p) {
  if (!p) return;
  const auto it = block_bytes_.find(p);
  MT_CHECK(it != block_bytes_.end(), "deallocate of a pointer this backend did not allocate");
  bytes_allocated_ -= it->second;
  block_bytes_.erase(it);
  MT_CUDA_CHECK(cudaFree(p));
}

void CudaBackend::copy_from_host(Tensor dst, const void* host_src) {
  on_device("copy_from_host", dst);
  if (dst.nbytes() == 0) return;
  MT_CUDA_CHECK(cudaMemcpyAsync(dst.data, host_src, dst.nbytes(), cudaMemcpyHostToDevice, stream_));
}

void CudaBackend::copy_to_host(void* host_dst, Tensor src) {
  on_device("copy_to_host", src);
  if (src.nbytes() == 0) return;
  MT_CUDA_CHECK(cudaMemcpyAsync(host_dst, src.data, src.nbytes(), cudaMemcpyDeviceToHost, stream_));
  MT_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackend::copy(Tensor dst, Tensor src) {
  on_device("copy", dst, src);
  MT_PROFILE_OP("copy {}", dst.shape_string());
  MT_CHECK(dst.dtype == src.dtype && dst.numel() == src.numel(), "copy: {} <- {}", dst.shape_string(),
           src.shape_string());
  if (dst.nbytes() == 0 || dst.data == src.data) return;
  MT_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, dst.nbytes(), cudaMemcpyDeviceToDevice, stream_));
}

// One strided copy: rows of `cols` elements from pitch src.cols() to pitch dst.cols().
void CudaBackend::copy_columns(Tensor dst, int64_t dst_col, Tensor src, int64_t src_col, int64_t cols) {
  on_device("copy_columns", dst, src);
  MT_PROFILE_OP("copy_columns {} <- {}", dst.shape_string(), src.shape_string());
  MT_CHECK(dst.dtype == src.dtype && dst.rows() == src.rows() && dst_col >= 0 && src_col >= 0 && cols >= 0 &&
               dst_col + cols <= dst.cols() && src_col + cols <= src.cols(),
           "copy_columns: [{}, +{}) of {} into [{}, +{}) of {}", src_col, cols, src.shape_string(), dst_col, cols,
           dst.shape_string());
  if (cols == 0 || dst.rows() == 0) return;
  const size_t e = dtype_size(dst.dtype);
  MT_CUDA_CHECK(cudaMemcpy2DAsync(static_cast<char*>(dst.data) + dst_col * e, dst.cols() * e,
                                  static_cast<const char*>(src.data) + src_col * e, src.cols() * e, cols * e,
                                  dst.rows(), cudaMemcpyDeviceToDevice, stream_));
}

void CudaBackend::synchronize() {
  MT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (side_stream_) MT_CUDA_CHECK(cudaStreamSynchronize(side_stream_));
  if (offload_stream_) MT_CUDA_CHECK(cudaStreamSynchronize(offload_stream_));
}

// ---- the side stream (the optimizer's update beside the next forward) -----------------------------
// With the op profiler on, side ops stay on the compute stream, where its events time them; a batch
// of side ops then counts as one optimizer step of the profile.
void CudaBackend::reserve_side_marks(int n) {
  if (!side_stream_ && !profiler_->enabled()) {  // (made at set-up: a step creates nothing)
    MT_CUDA_CHECK(cudaStreamCreateWithPriority(&side_stream_, cudaStreamNonBlocking, lowest_priority_));
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&side_start_, cudaEventDisableTiming));
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&side_done_, cudaEventDisableTiming));
  }
  reserve_events(side_marks_, n, cudaEventDisableTiming);
}
void CudaBackend::begin_side_ops() {
  MT_CHECK(!side_ops_, "begin_side_ops twice without end_side_ops");
  side_ops_ = true;
  if (!side_stream_) return;  // (the op profiler: side ops stay on the compute stream)
  MT_CUDA_CHECK(cudaEventRecord(side_start_, stream_));
  MT_CUDA_CHECK(cudaStreamWaitEvent(side_stream_, side_start_, 0));
}
void CudaBackend::end_side_ops() {
  MT_CHECK(side_ops_, "end_side_ops without begin_side_ops");
  side_ops_ = false;
  profiler_->step_done();
}
void CudaBackend::record_side_mark(int i) {
  MT_CHECK(i >= 0 && i < static_cast<int>(side_marks_.size()), "side mark {} of {} reserved", i, side_marks_.size());
  MT_CUDA_CHECK(cudaEventRecord(side_marks_[static_cast<size_t>(i)], side_stream_ ? side_stream_ : stream_));
}
void CudaBackend::compute_wait_for_side_mark(int i) {
  MT_CHECK(i >= 0 && i < static_cast<int>(side_marks_.size()), "side mark {} of {} reserved", i, side_marks_.size());
  if (side_stream_) MT_CUDA_CHECK(cudaStreamWaitEvent(stream_, side_marks_[static_cast<size_t>(i)], 0));
}
void CudaBackend::compute_wait_for_side() {
  if (!side_stream_) return;
  MT_CUDA_CHECK(cudaEventRecord(side_done_, side_stream_));
  MT_CUDA_CHECK(cudaStreamWaitEvent(stream_, side_done_, 0));
}

// ---- activation offloading ------------------------------------------------------------------------
// Pinned host memory, and one copy stream beside compute (its copies run in the order issued).
void* CudaBackend::allocate_host(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  if (cudaHostAlloc(&p, bytes, cudaHostAllocDefault) != cudaSuccess) {
    cudaGetLastError();
    fail("out of pinned host memory allocating {:.1f} MiB for offloaded activations: offload fewer modules "
         "(--offload-modules, --activation-offload-fraction) or add host memory",
         bytes / 1048576.0);
  }
  return p;
}
void CudaBackend::deallocate_host(void* p) {
  if (!p) return;
  if (offload_stream_) MT_CUDA_CHECK(cudaStreamSynchronize(offload_stream_));
  MT_CUDA_CHECK(cudaFreeHost(p));
}
void CudaBackend::reserve_offload_marks(int n) {
  if (!offload_stream_) {  // (made at set-up: a step creates nothing)
    MT_CUDA_CHECK(cudaStreamCreateWithPriority(&offload_stream_, cudaStreamNonBlocking, highest_priority_));
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&offload_start_, cudaEventDisableTiming));
  }
  reserve_events(offload_marks_, n, cudaEventDisableTiming);
}
void CudaBackend::offload_copy(void* dst, const void* src, size_t bytes, int mark) {
  MT_CHECK(offload_stream_ && mark >= 0 && mark < static_cast<int>(offload_marks_.size()), "offload mark {} of {} reserved",
           mark, offload_marks_.size());
  MT_CUDA_CHECK(cudaEventRecord(offload_start_, stream_));
  MT_CUDA_CHECK(cudaStreamWaitEvent(offload_stream_, offload_start_, 0));
  if (bytes) MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, offload_stream_));
  MT_CUDA_CHECK(cudaEventRecord(offload_marks_[static_cast<size_t>(mark)], offload_stream_));
}
void CudaBackend::compute_wait_for_offload_mark(int mark) {
  MT_CHECK(mark >= 0 && mark < static_cast<int>(offload_marks_.size()), "offload mark {} of {} reserved", mark,
           offload_marks_.size());
  MT_CUDA_CHECK(cudaStreamWaitEvent(stream_, offload_marks_[static_cast<size_t>(mark)], 0));
}

// ---- communication overlap ------------------------------------------------------------------------
// A stream waits for the last record of an event made before the wait is enqueued, so one event per
// direction suffices: each hand-over records it anew.
void CudaBackend::comm_wait_for_compute() {
  MT_CUDA_CHECK(cudaEventRecord(compute_done_, stream_));
  MT_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, compute_done_, 0));
}
void CudaBackend::tp_comm_wait_for_compute() {
  MT_CUDA_CHECK(cudaEventRecord(tp_compute_done_, stream_));
  MT_CUDA_CHECK(cudaStreamWaitEvent(tp_comm_stream_, tp_compute_done_, 0));
}
void CudaBackend::compute_wait_for_tp_comm() {
  MT_CUDA_CHECK(cudaEventRecord(tp_comm_done_, tp_comm_stream_));
  MT_CUDA_CHECK(cudaStreamWaitEvent(stream_, tp_comm_done_, 0));
}
void CudaBackend::compute_wait_for_comm() {
  MT_CUDA_CHECK(cudaEventRecord(comm_done_, comm_stream_));
  MT_CUDA_CHECK(cudaStreamWaitEvent(stream_, comm_done_, 0));
}
void CudaBackend::reserve_comm_marks(int n) {
  reserve_events(comm_marks_, n, cudaEventDisableTiming);
}
void CudaBackend::record_comm_mark(int i) {
  MT_CHECK(i >= 0 && i < static_cast<int>(comm_marks_.size()), "comm mark {} of {} reserved", i, comm_marks_.size());
  MT_CUDA_CHECK(cudaEventRecord(comm_marks_[static_cast<size_t>(i)], comm_stream_));
}
void CudaBackend::reserve_time_marks(int n) {
  reserve_events(time_marks_, n, cudaEventDefault);  // (with timing)
}
void CudaBackend::record_time_mark(int i) {
  MT_CHECK(i >= 0 && i < static_cast<int>(time_marks_.size()), "time mark {} of {} reserved", i, time_marks_.size());
  MT_CUDA_CHECK(cudaEventRecord(time_marks_[static_cast<size_t>(i)], stream_));
}
double CudaBackend::time_between_marks_ms(int a, int b) {
  MT_CHECK(a >= 0 && b >= 0 && a < static_cast<int>(time_marks_.size()) && b < static_cast<int>(time_marks_.size()),
           "time marks {} and {} of {} reserved", a, b, time_marks_.size());
  float ms = 0;
  MT_CUDA_CHECK(cudaEventSynchronize(time_marks_[static_cast<size_t>(b)]));  // (complete already after a read back)
  MT_CUDA_CHECK(cudaEventElapsedTime(&ms, time_marks_[static_cast<size_t>(a)], time_marks_[static_cast<size_t>(b)]));
  return ms;
}
void CudaBackend::compute_wait_for_mark(int i) {
  MT_CHECK(i >= 0 && i < static_cast<int>(comm_marks_.size()), "comm mark {} of {} reserved", i, comm_marks_.size());
  MT_CUDA_CHECK(cudaStreamWaitEvent(stream_, comm_marks_[static_cast<size_t>(i)], 0));
}

// ---- elementwise --------------------------------------------------------------------------------
void CudaBackend::fill(Tensor t, double value) {
  on_device("fill", t);
  MT_PROFILE_OP("fill {} {}", dtype_name(t.dtype), t.numel());
  cuda::fill(context(), t, value);
}
void CudaBackend::fill_ranges(Tensor flat, const std::vector<FlatRange>& ranges, double value) {
  if (value != 0.0 || std::signbit(value)) {
    Backend::fill_ranges(flat, ranges, value);
    return;
  }
  on_device("fill_ranges", flat);
  MT_PROFILE_OP("fill_ranges {} {} ranges", dtype_name(flat.dtype), ranges.size());
  cuda::zero_ranges(context(), flat, ranges);
}
void CudaBackend::cast(Tensor dst, Tensor src) {
  on_device("cast", dst, src);
  MT_PROFILE_OP("cast {} <- {} {}", dtype_name(dst.dtype), dtype_name(src.dtype), dst.numel());
  cuda::cast(context(), dst, src);
}
void CudaBackend::axpby(Tensor out, float alpha, Tensor a, float beta, Tensor b) {
  on_device("axpby", out, a, b);
  MT_PROFILE_OP("axpby {}", out.shape_string());
  cuda::axpby(context(), out, alpha, a, beta, b);
}
void CudaBackend::scale_by_rnorm(Tensor x, Tensor sumsq, float eps) {
  on_device("scale_by_rnorm", x, sumsq);
  MT_PROFILE_OP("scale_by_rnorm {}", x.shape_string());
  cuda::scale_by_rnorm(context(), x, sumsq, eps);
}
void CudaBackend::init_normal(Tensor t, uint64_t key, float std, const ShardIndex& index) {
  on_device("init_normal", t);
  cuda::init_normal(context(), t, key, std, index);
}
void CudaBackend::init_uniform(Tensor t, uint64_t key, float lo, float hi, bool log_of, const ShardIndex& index) {
  on_device("init_uniform", t);
  cuda::init_uniform(context(), t, key, lo, hi, log_of, index);
}

// ---- embedding ----------------------------------------------------------------------------------
void CudaBackend::embedding_forward(Tensor out, Tensor tokens, Tensor positions, Tensor wte, Tensor wpe,
                                    int64_t vocab_start) {
  on_device("embedding_forward", out, tokens, positions, wte, wpe);
  MT_PROFILE_OP("embedding_forward {}", out.shape_string());
  cuda::embedding_forward(context(), out, tokens, positions, wte, wpe, vocab_start);
}
void CudaBackend::embedding_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens, Tensor positions,
                                     int64_t vocab_start) {
  on_device("embedding_backward", dwte, dwpe, dout, tokens, positions);
  MT_PROFILE_OP("embedding_backward {}", dout.shape_string());
  cuda::embedding_backward(context(), dwte, dwpe, dout, tokens, positions, vocab_start);
}

// ---- normalization ------------------------------------------------------------------------------
void CudaBackend::norm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor x, Tensor weight, Tensor bias,
                               const NormParams& p, Tensor out_amax) {
  on_device("norm_forward", out, mean, rstd, x, weight, bias, out_amax);
  MT_PROFILE_OP("norm_forward {}{}", x.shape_string(), out_amax.empty() ? "" : " +amax");
  cuda::norm_forward(context(), Tensor(), out, mean, rstd, x, Tensor(), 0.0f, 0, weight, bias, p, Tensor(), out_amax);
}
void CudaBackend::add_norm_forward(Tensor sum, Tensor out, Tensor mean, Tensor rstd, Tensor a, Tensor b,
                                   float dropout_p, uint64_t dropout_key, Tensor weight, Tensor bias,
                                   const NormParams& p) {
  on_device("add_norm_forward", sum, out, mean, rstd, a, b, weight, bias);
  MT_PROFILE_OP("add_norm_forward {}", a.shape_string());
  MT_CHECK(!b.empty(), "add_norm_forward: b is required");
  cuda::norm_forward(context(), sum, out, mean, rstd, a, b, dropout_p, dropout_key, weight, bias, p);
}
void CudaBackend::bias_dropout_add_norm(Tensor sum, Tensor out, Tensor mean, Tensor rstd, Tensor residual, Tensor x,
                                        Tensor x_bias, float dropout_p, uint64_t dropout_key, Tensor weight,
                                        Tensor bias, const NormParams& p, Tensor out_amax) {
  on_device("bias_dropout_add_norm", sum, out, mean, rstd, residual, x, x_bias, weight, bias, out_amax);
  MT_PROFILE_OP("bias_dropout_add_norm {}{}", x.shape_string(), out_amax.empty() ? "" : " +amax");
  MT_CHECK(!x.empty(), "bias_dropout_add_norm: x is required");
  cuda::norm_forward(context(), sum, out, mean, rstd, residual, x, dropout_p, dropout_key, weight, bias, p, x_bias,
                     out_amax);
}
void CudaBackend::norm_backward(Tensor dx, Tensor dweight, Tensor dbias, Tensor dout, Tensor x, Tensor mean,
                                Tensor rstd, Tensor weight, Tensor dresidual, Tensor dx_colsum, const NormParams& p,
                                Tensor dx_amax) {
  on_device("norm_backward", dx, dweight, dbias, dout, x, mean, rstd, weight, dresidual, dx_colsum, dx_amax);
  MT_PROFILE_OP("norm_backward {}{}{}", x.shape_string(), dx_colsum.empty() ? "" : " +dx sums",
                dx_amax.empty() ? "" : " +amax");
  cuda::norm_backward(context(), dx, dweight, dbias, dout, x, mean, rstd, weight, dresidual, p, Tensor(), Tensor(),
                      dx_colsum, dx_amax);
}

void CudaBackend::norm_backward_recompute(Tensor out, Tensor dx, Tensor dweight, Tensor dbias, Tensor dout, Tensor x,
                                          Tensor mean, Tensor rstd, Tensor weight, Tensor bias, Tensor dresidual,
                                          Tensor dx_colsum, const NormParams& p) {
  on_device("norm_backward_recompute", out, dx, dweight, dbias, dout, x, mean, rstd, weight, bias, dresidual, dx_colsum);
  MT_PROFILE_OP("norm_backward_recompute {}{}", x.shape_string(), dx_colsum.empty() ? "" : " +dx sums");
  MT_CHECK(!out.empty(), "norm_backward_recompute: out is required");
  cuda::norm_backward(context(), dx, dweight, dbias, dout, x, mean, rstd, weight, dresidual, p, out, bias, dx_colsum);
}

void CudaBackend::qk_norm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor qkv, Tensor q_weight, Tensor q_bias,
                                  Tensor k_weight, Tensor k_bias, const RopeShape& r, const NormParams& p) {
  on_device("qk_norm_forward", out, mean, rstd, qkv, q_weight, q_bias, k_weight, k_bias);
  MT_PROFILE_OP("qk_norm_forward {}", qkv.shape_string());
  cuda::qk_norm_forward(context(), out, mean, rstd, qkv, q_weight, q_bias, k_weight, k_bias, r, p);
}
void CudaBackend::qk_norm_backward(Tensor dqkv, Tensor dq_weight, Tensor dq_bias, Tensor dk_weight, Tensor dk_bias,
                                   Tensor dout, Tensor qkv, Tensor mean, Tensor rstd, Tensor q_weight,
                                   Tensor k_weight, const RopeShape& r, const NormParams& p) {
  on_device("qk_norm_backward", dqkv, dq_weight, dq_bias, dk_weight, dk_bias, dout, qkv, mean, rstd, q_weight,
            k_weight);
  MT_PROFILE_OP("qk_norm_backward {}", qkv.shape_string());
  cuda::qk_norm_backward(context(), dqkv, dq_weight, dq_bias, dk_weight, dk_bias, dout, qkv, mean, rstd, q_weight,
                         k_weight, r, p);
}

// ---- linear layers ------------------------------------------------------------------------------
void CudaBackend::linear_forward(Tensor y, Tensor x, Tensor w, Tensor bias, Activation act, Tensor pre_act) {
  on_device("linear_forward", y, x, w, bias, pre_act);
  MT_PROFILE_OP("linear_forward {}x{}x{}{}{}", x.rows(), w.rows(), x.cols(), bias.empty() ? "" : " +bias", act == Activation::none ? "" : " +act");
  const cuda::KernelContext ctx = context();
  cuda::linear_forward(*gemm_, ctx, y, x, w, bias, act, pre_act);
}
void CudaBackend::linear_backward_input(Tensor dx, Tensor dy, Tensor w, bool accumulate, Activation act,
                                        Tensor pre_act) {
  on_device("linear_backward_input", dx, dy, w, pre_act);
  MT_PROFILE_OP("linear_backward_input {}x{}x{}{}{}", dy.rows(), w.cols(), w.rows(), accumulate ? " +acc" : "", act == Activation::none ? "" : " +act");
  const cuda::KernelContext ctx = context();
  cuda::linear_backward_input(*gemm_, ctx, dx, dy, w, accumulate, act, pre_act);
}
void CudaBackend::linear_backward_weight(Tensor dw, Tensor dbias, Tensor dy, Tensor x, bool accumulate) {
  on_device("linear_backward_weight", dw, dbias, dy, x);
  MT_PROFILE_OP("linear_backward_weight {}x{}x{}{}{}", dw.rows(), dw.cols(), dy.rows(), accumulate ? " +acc" : "",
                dbias.empty() ? "" : " +dbias");
  const cuda::KernelContext ctx = context();
  cuda::linear_backward_weight(*gemm_, ctx, dw, dbias, dy, x, accumulate);
}

void CudaBackend::linear_backward_input_recompute(Tensor dx, Tensor act_out, Tensor dy, Tensor w, Activation act,
                                                  Tensor pre_act) {
  on_device("linear_backward_input_recompute", dx, act_out, dy, w, pre_act);
  MT_PROFILE_OP("linear_backward_input_recompute {}x{}x{}", dy.rows(), w.cols(), w.rows());
  const cuda::KernelContext ctx = context();
  cuda::linear_backward_input_recompute(*gemm_, ctx, dx, act_out, dy, w, act, pre_act);
}

// ---- activations --------------------------------------------------------------------------------
void CudaBackend::activation_forward(Tensor out, Tensor in, Activation act) {
  on_device("activation_forward", out, in);
  MT_PROFILE_OP("activation_forward {}", in.shape_string());
  cuda::activation_forward(context(), out, in, act);
}
void CudaBackend::activation_backward(Tensor din, Tensor dout, Tensor in, Activation act) {
  on_device("activation_backward", din, dout, in);
  MT_PROFILE_OP("activation_backward {}", in.shape_string());
  cuda::activation_backward(context(), din, dout, in, act);
}
void CudaBackend::swiglu_forward(Tensor out, Tensor in, const Glu& g) {
  on_device("swiglu_forward", out, in);
  MT_PROFILE_OP("swiglu_forward {}", in.shape_string());
  cuda::swiglu_forward(context(), out, in, g);
}
void CudaBackend::swiglu_backward(Tensor din, Tensor dout, Tensor in, const Glu& g) {
  on_device("swiglu_backward", din, dout, in);
  MT_PROFILE_OP("swiglu_backward {}", in.shape_string());
  cuda::swiglu_backward(context(), din, dout, in, g);
}
void CudaBackend::swiglu_backward_recompute(Tensor din, Tensor act_out, Tensor dout, Tensor in, const Glu& g) {
  on_device("swiglu_backward_recompute", din, act_out, dout, in);
  MT_PROFILE_OP("swiglu_backward_recompute {}", in.shape_string());
  cuda::swiglu_backward_recompute(context(), din, act_out, dout, in, g);
}
void CudaBackend::attention_gate_split(Tensor qkv, Tensor gate, Tensor qkvg, const GateShape& s) {
  on_device("attention_gate_split", qkv, gate, qkvg);
  MT_PROFILE_OP("attention_gate_split {}", qkvg.shape_string());
  cuda::attention_gate_split(context(), qkv, gate, qkvg, s);
}
void CudaBackend::attention_gate_merge(Tensor qkvg, Tensor qkv, Tensor gate, const GateShape& s) {
  on_device("attention_gate_merge", qkvg, qkv, gate);
  MT_PROFILE_OP("attention_gate_merge {}", qkvg.shape_string());
  cuda::attention_gate_merge(context(), qkvg, qkv, gate, s);
}
void CudaBackend::output_gate_forward(Tensor out, Tensor x, Tensor gate) {
  on_device("output_gate_forward", out, x, gate);
  MT_PROFILE_OP("output_gate_forward {}", x.shape_string());
  cuda::output_gate_forward(context(), out, x, gate);
}
void CudaBackend::output_gate_backward(Tensor dx, Tensor dgate, Tensor dout, Tensor x, Tensor gate) {
  on_device("output_gate_backward", dx, dgate, dout, x, gate);
  MT_PROFILE_OP("output_gate_backward {}", x.shape_string());
  cuda::output_gate_backward(context(), dx, dgate, dout, x, gate);
}
void CudaBackend::bias_dropout_add(Tensor out, Tensor x, Tensor bias, Tensor residual, float dropout_p,
                                   uint64_t dropout_key) {
  on_device("bias_dropout_add", out, x, bias, residual);
  MT_PROFILE_OP("bias_dropout_add {}{}", x.shape_string(), dropout_p > 0 ? " +dropout" : "");
  cuda::bias_dropout_add(context(), out, x, bias, residual, dropout_p, dropout_key);
}
void CudaBackend::dropout_backward(Tensor dx, Tensor dout, float dropout_p, uint64_t dropout_key, Tensor dx_amax) {
  on_device("dropout_backward", dx, dout, dx_amax);
  MT_PROFILE_OP("dropout_backward {}{}", dx.shape_string(), dx_amax.empty() ? "" : " +amax");
  cuda::dropout_backward(context(), dx, dout, dropout_p, dropout_key,
                         cuda::amax_slot_ptr(dx_amax, "dropout_backward", "dx_amax"));
}

// ---- mixture of experts (cuda/moe_kernels.cu) ------------------------------------------------
void CudaBackend::moe_route(Tensor probs, Tensor idx, Tensor logits, Tensor expert_bias, const MoeRouting& r) {
  on_device("moe_route", probs, idx, logits, expert_bias);
  MT_PROFILE_OP("moe_route {} top{}", logits.shape_string(), r.topk);
  cuda::moe_route(context(), probs, idx, logits, expert_bias, r);
}
void CudaBackend::moe_route_backward(Tensor dlogits, Tensor dprobs, Tensor logits, Tensor idx, Tensor aux_grad,
                                     const MoeRouting& r) {
  on_device("moe_route_backward", dlogits, dprobs, logits, idx, aux_grad);
  MT_PROFILE_OP("moe_route_backward {} top{}", logits.shape_string(), r.topk);
  cuda::moe_route_backward(context(), dlogits, dprobs, logits, idx, aux_grad, r);
}
void CudaBackend::moe_aux_stats(Tensor stats, Tensor logits, const MoeRouting& r) {
  on_device("moe_aux_stats", stats, logits);
  MT_PROFILE_OP("moe_aux_stats {}", logits.shape_string());
  cuda::moe_aux_stats(context(), stats, logits, r);
}
void CudaBackend::moe_aux_grad(Tensor aux_grad, Tensor logits, Tensor stats, float aux_scale, float z_scale,
                               const MoeRouting& r) {
  on_device("moe_aux_grad", aux_grad, logits, stats);
  MT_PROFILE_OP("moe_aux_grad {}", logits.shape_string());
  cuda::moe_aux_grad(context(), aux_grad, logits, stats, aux_scale, z_scale, r);
}
void CudaBackend::moe_aux_log(Tensor sums, Tensor stats, float aux_scale, float z_scale) {
  on_device("moe_aux_log", sums, stats);
  MT_PROFILE_OP("moe_aux_log");
  cuda::moe_aux_log(context(), sums, stats, aux_scale, z_scale);
}
void CudaBackend::moe_count_rows(Tensor counts, Tensor offsets) {
  on_device("moe_count_rows", counts, offsets);
  MT_PROFILE_OP("moe_count_rows {} experts", counts.numel());
  cuda::moe_count_rows(context(), counts, offsets);
}
void CudaBackend::moe_jitter(Tensor out, Tensor in, float eps, uint64_t key, int64_t index0) {
  on_device("moe_jitter", out, in);
  MT_PROFILE_OP("moe_jitter {}", in.shape_string());
  cuda::moe_jitter(context(), out, in, eps, key, index0);
}
void CudaBackend::moe_permute_plan(Tensor order, Tensor slot_of, Tensor offsets, Tensor idx, int first_expert,
                                   int num_experts) {
  on_device("moe_permute_plan", order, slot_of, offsets, idx);
  MT_PROFILE_OP("moe_permute_plan {} pairs {} experts", idx.numel(), num_experts);
  cuda::moe_permute_plan(context(), order, slot_of, offsets, idx, first_expert, num_experts);
}
void CudaBackend::moe_gather_rows(Tensor out, Tensor x, Tensor index, int k) {
  on_device("moe_gather_rows", out, x, index);
  MT_PROFILE_OP("moe_gather_rows {}", out.shape_string());
  cuda::moe_gather_rows(context(), out, x, index, k);
}
void CudaBackend::moe_combine(Tensor out, Tensor y, Tensor slot_of, int k, bool accumulate) {
  on_device("moe_combine", out, y, slot_of);
  MT_PROFILE_OP("moe_combine {}{}", out.shape_string(), accumulate ? " +acc" : "");
  cuda::moe_combine(context(), out, y, slot_of, k, accumulate);
}
void CudaBackend::moe_scale_rows(Tensor out, Tensor x, Tensor p) {
  on_device("moe_scale_rows", out, x, p);
  MT_PROFILE_OP("moe_scale_rows {}", x.shape_string());
  cuda::moe_scale_rows(context(), out, x, p);
}
void CudaBackend::moe_scale_rows_backward(Tensor dx, Tensor dp, Tensor dout, Tensor x, Tensor p) {
  on_device("moe_scale_rows_backward", dx, dp, dout, x, p);
  MT_PROFILE_OP("moe_scale_rows_backward {}", x.shape_string());
  cuda::moe_scale_rows_backward(context(), dx, dp, dout, x, p);
}

void CudaBackend::grouped_bias_forward(Tensor y, Tensor bias, Tensor p, const ExpertOffsets& offsets) {
  on_device("grouped_bias_forward", y, bias, p, offsets.device);
  MT_PROFILE_OP("grouped_bias_forward {} ({} experts)", y.shape_string(), offsets.experts());
  cuda::grouped_bias_forward(context(), y, bias, p, offsets);
}

void CudaBackend::grouped_bias_backward(Tensor dbias, Tensor dp, Tensor dy, Tensor bias, Tensor p,
                                        const ExpertOffsets& offsets, bool accumulate) {
  on_device("grouped_bias_backward", dbias, dp, dy, bias, p, offsets.device);
  MT_PROFILE_OP("grouped_bias_backward {} ({} experts){}", dy.shape_string(), offsets.experts(),
                accumulate ? " +acc" : "");
  cuda::grouped_bias_backward(context(), dbias, dp, dy, bias, p, offsets, accumulate);
}
void CudaBackend::moe_swiglu_forward(Tensor out, Tensor in, Tensor p, const Glu& g) {
  on_device("moe_swiglu_forward", out, in, p);
  MT_PROFILE_OP("moe_swiglu_forward {}", in.shape_string());
  cuda::moe_swiglu_forward(context(), out, in, p, g);
}
void CudaBackend::moe_swiglu_backward(Tensor din, Tensor act, Tensor dp, Tensor dout, Tensor in, Tensor p,
                                      const Glu& g) {
  on_device("moe_swiglu_backward", din, act, dp, dout, in, p);
  MT_PROFILE_OP("moe_swiglu_backward {}", in.shape_string());
  cuda::moe_swiglu_backward(context(), din, act, dp, dout, in, p, g);
}

// ---- rotary embeddings --------------------------------------------------------------------------
void CudaBackend::rope_forward(Tensor qkv, Tensor positions, Tensor cos_sin, const RopeShape& r) {
  on_device("rope_forward", qkv, positions, cos_sin);
  MT_PROFILE_OP("rope_forward {}", qkv.shape_string());
  cuda::rope(context(), qkv, positions, cos_sin, r, false);
}
void CudaBackend::rope_backward(Tensor dqkv, Tensor positions, Tensor cos_sin, const RopeShape& r) {
  on_device("rope_backward", dqkv, positions, cos_sin);
  MT_PROFILE_OP("rope_backward {}", dqkv.shape_string());
  cuda::rope(context(), dqkv, positions, cos_sin, r, true);
}

void CudaBackend::mla_qkv_forward(Tensor qkv, Tensor q, Tensor kv, Tensor down, Tensor positions, Tensor cos_sin,
                                  const MlaShape& m) {
  on_device("mla_qkv_forward", qkv, q, kv, down, positions, cos_sin);
  MT_PROFILE_OP("mla_qkv_forward {}", qkv.shape_string());
  cuda::mla_qkv(context(), qkv, q, kv, down, positions, cos_sin, m, false);
}
void CudaBackend::mla_qkv_backward(Tensor dq, Tensor dkv, Tensor ddown, Tensor dqkv, Tensor positions, Tensor cos_sin,
                                   const MlaShape& m) {
  on_device("mla_qkv_backward", dq, dkv, ddown, dqkv, positions, cos_sin);
  MT_PROFILE_OP("mla_qkv_backward {}", dqkv.shape_string());
  cuda::mla_qkv(context(), dqkv, dq, dkv, ddown, positions, cos_sin, m, true);
}

// ---- attention (cuda/attention_*.cu) ------------------------------------------------------------
void CudaBackend::reserve_attention(const AttentionShape& a, AttentionBackend backend, DType dtype) {
  attention_backend_ = backend;
  // Training's shape and evaluation's (no dropout: auto may pick another implementation); either
  // one that cannot run throws Unsupported here, at set-up.
  AttentionShape eval = a;
  eval.dropout_p = 0;
  const size_t need = std::max(cuda::attention_workspace_bytes(a, backend, dtype),
                               cuda::attention_workspace_bytes(eval, backend, dtype));
  log::info(" > attention: {}", cuda::describe_attention(a, backend, dtype));
  if (a.dropout_p > 0) log::info(" > attention (evaluation, no dropout): {}", cuda::describe_attention(eval, backend, dtype));
  reserve_buffer(attention_workspace_, attention_workspace_bytes_, need);
}

void CudaBackend::reserve_buffer(void*& buffer, size_t& bytes, size_t need) {
  if (need <= bytes) return;
  MT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  deallocate(buffer);
  buffer = nullptr;
  bytes = 0;
  buffer = allocate(need);
  bytes = need;
}

void CudaBackend::attention_forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a) {
  on_device("attention_forward", out, lse, qkv);
  MT_PROFILE_OP("attention_forward b{} s{} h{}/{} d{}{}{}", a.batch, a.seq, a.heads, a.groups, a.head_dim,
                a.dropout_p > 0 ? " +dropout" : "", a.windowed() ? " window " + std::to_string(a.window_left) : "");
  const size_t need = cuda::attention_workspace_bytes(a, attention_backend_, qkv.dtype);
  MT_CHECK(need <= attention_workspace_bytes_,
           "attention_forward needs {} bytes of workspace, {} reserved (call reserve_attention at set-up)", need,
           attention_workspace_bytes_);
  cuda::attention_forward(out, lse, qkv, a, attention_backend_, attention_workspace_, attention_workspace_bytes_,
                          stream_);
}

void CudaBackend::attention_backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv,
                                     const AttentionShape& a) {
  on_device("attention_backward", dqkv, dout, out, lse, qkv);
  MT_PROFILE_OP("attention_backward b{} s{} h{}/{} d{}{}{}", a.batch, a.seq, a.heads, a.groups, a.head_dim,
                a.dropout_p > 0 ? " +dropout" : "", a.windowed() ? " window " + std::to_string(a.window_left) : "");
  const size_t need = cuda::attention_workspace_bytes(a, attention_backend_, qkv.dtype);
  MT_CHECK(need <= attention_workspace_bytes_,
           "attention_backward needs {} bytes of workspace, {} reserved (call reserve_attention at set-up)", need,
           attention_workspace_bytes_);
  cuda::attention_backward(dqkv, dout, out, lse, qkv, a, attention_backend_, attention_workspace_,
                           attention_workspace_bytes_, stream_);
}

// ---- cross-entropy ------------------------------------------------------------------------------
void CudaBackend::cross_entropy_forward(Tensor lse, Tensor target, Tensor logits, Tensor labels, int64_t vocab_start) {
  on_device("cross_entropy_forward", lse, target, logits, labels);
  MT_PROFILE_OP("cross_entropy_forward {}", logits.shape_string());
  cuda::cross_entropy_forward(context(), lse, target, logits, labels, vocab_start);
}
void CudaBackend::cross_entropy_backward(Tensor dlogits, Tensor logits, Tensor labels, Tensor lse, Tensor dloss,
                                         int64_t vocab_start) {
  on_device("cross_entropy_backward", dlogits, logits, labels, lse, dloss);
  MT_PROFILE_OP("cross_entropy_backward {}", logits.shape_string());
  cuda::cross_entropy_backward(context(), dlogits, logits, labels, lse, dloss, vocab_start);
}
void CudaBackend::cross_entropy_forward_backward(Tensor lse, Tensor target, Tensor logits, Tensor labels,
                                                 Tensor dloss) {
  on_device("cross_entropy_forward_backward", lse, target, logits, labels, dloss);
  MT_PROFILE_OP("cross_entropy_forward_backward {}", logits.shape_string());
  cuda::cross_entropy_forward_backward(context(), lse, target, logits, labels, dloss);
}
void CudaBackend::logsumexp_combine(Tensor lse_out, Tensor lse_parts) {
  on_device("logsumexp_combine", lse_out, lse_parts);
  MT_PROFILE_OP("logsumexp_combine");
  cuda::logsumexp_combine(context(), lse_out, lse_parts);
}
void CudaBackend::masked_loss_sum(Tensor out, Tensor loss, Tensor mask, bool accumulate) {
  on_device("masked_loss_sum", out, loss, mask);
  MT_PROFILE_OP("masked_loss_sum");
  cuda::masked_loss_sum(context(), out, loss, mask, accumulate);
}
void CudaBackend::logits_argmax(Tensor max, Tensor index, Tensor logits, int64_t vocab_start) {
  on_device("logits_argmax", max, index, logits);
  MT_PROFILE_OP("logits_argmax {}", logits.shape_string());
  cuda::logits_argmax(context(), max, index, logits, vocab_start);
}
void CudaBackend::argmax_match_count(Tensor out, Tensor max_parts, Tensor index_parts, Tensor labels, Tensor mask,
                                     bool accumulate) {
  on_device("argmax_match_count", out, max_parts, index_parts, labels, mask);
  MT_PROFILE_OP("argmax_match_count");
  cuda::argmax_match_count(context(), out, max_parts, index_parts, labels, mask, accumulate);
}

// ---- optimizer ----------------------------------------------------------------------------------
void CudaBackend::register_optim_segments(std::span<const OptimSegment> segments) {
  for (const auto& r : registered_segments_)
    if (std::ranges::equal(segments, r.host)) return;
  RegisteredSegments r;
  r.host.assign(segments.begin(), segments.end());
  std::vector<cuda::DeviceSegment> table(segments.size());
  cuda::build_segment_table(segments, table.data(), &r.total_chunks);
  for (const auto& s : segments) r.max_end = std::max(r.max_end, s.offset + s.count);
  if (!table.empty()) {
    r.device = static_cast<cuda::DeviceSegment*>(allocate(table.size() * sizeof(cuda::DeviceSegment)));
    MT_CUDA_CHECK(cudaMemcpyAsync(r.device, table.data(), table.size() * sizeof(cuda::DeviceSegment),
                                  cudaMemcpyHostToDevice, stream_));
    MT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  registered_segments_.push_back(std::move(r));
}

cuda::SegmentArg CudaBackend::segment_arg(std::span<const OptimSegment> segments, int64_t numel, const char* what) {
  cuda::SegmentArg arg;
  if (segments.empty()) {  // the whole tensor
    const OptimSegment whole{0, numel, 0};
    cuda::build_segment_table(std::span<const OptimSegment>(&whole, 1), arg.inline_segments, &arg.total_chunks);
    arg.count = 1;
    return arg;
  }
  for (const auto& r : registered_segments_) {
    if (!std::ranges::equal(segments, r.host)) continue;
    MT_CHECK(r.max_end <= numel, "{}: segments reach element {} of a {}-element buffer", what, r.max_end, numel);
    arg.table = r.device;
    arg.count = static_cast<int>(segments.size());
    arg.total_chunks = r.total_chunks;
    return arg;
  }
  if (segments.size() > static_cast<size_t>(cuda::kInlineSegments))
    fail("{}: a list of {} optimizer segments was not registered; call Backend::register_optim_segments with it at "
         "set-up (lists of up to {} work unregistered)", what, segments.size(), cuda::kInlineSegments);
  int64_t max_end = 0;
  for (const auto& s : segments) max_end = std::max(max_end, s.offset + s.count);
  MT_CHECK(max_end <= numel, "{}: segments reach element {} of a {}-element buffer", what, max_end, numel);
  cuda::build_segment_table(segments, arg.inline_segments, &arg.total_chunks);
  arg.count = static_cast<int>(segments.size());
  return arg;
}

namespace {
// An FP8 model copy is written with each segment's scale and amax (all of them); another copy
// takes no scale (an amax is optional: OptimSegment::fp8_amax).
void check_model_copy_segments(const Tensor& model, std::span<const OptimSegment> segments, const char* op) {
  const bool fp8 = !model.empty() && is_fp8(model.dtype);
  MT_CHECK(!fp8 || model.dtype == DType::fp8_e4m3, "{}: an FP8 model copy must be e4m3", op);
  MT_CHECK(!fp8 || !segments.empty(), "{}: an FP8 model copy needs segments with its scales", op);
  for (const OptimSegment& s : segments)
    MT_CHECK(fp8 == (s.fp8_scale != nullptr) && (!fp8 || s.fp8_amax),
             "{}: a segment {} an FP8 scale{} for a {} model copy", op, fp8 ? "without" : "with",
             fp8 ? " and amax" : "", model.empty() ? "missing" : dtype_name(model.dtype));
}
}  // namespace

void CudaBackend::split_master(Tensor model, Tensor remainder, Tensor master, TieBits ties) {
  on_device("split_master", model, remainder, master, ties.words);
  MT_PROFILE_OP("split_master {}", master.numel());
  cuda::split_master(context(), model, remainder, master, ties);
}
void CudaBackend::master_sum_squares(Tensor out, Tensor model, Tensor remainder, TieBits ties,
                                     std::span<const OptimSegment> segments, bool accumulate) {
  on_device("master_sum_squares", out, model, remainder, ties.words);
  MT_PROFILE_OP("master_sum_squares {}", remainder.numel());
  cuda::master_sum_squares(context(), out, model, remainder, ties,
                           segment_arg(segments, remainder.numel(), "master_sum_squares"), accumulate);
}
void CudaBackend::join_master(Tensor master, Tensor model, Tensor remainder, TieBits ties) {
  on_device("join_master", master, model, remainder, ties.words);
  MT_PROFILE_OP("join_master {}", remainder.numel());
  cuda::join_master(context(), master, model, remainder, ties);
}
void CudaBackend::adamw_step(Tensor master, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq, Tensor model_param,
                             std::span<const OptimSegment> segments, const OptimStepParams& p, TieBits ties) {
  on_device("adamw_step", master, grad, exp_avg, exp_avg_sq, model_param, ties.words);
  check_model_copy_segments(model_param, segments, "adamw_step");
  MT_PROFILE_OP("adamw_step {}", master.numel());
  cuda::adamw_step(context(), master, grad, exp_avg, exp_avg_sq, model_param,
                   segment_arg(segments, master.numel(), "adamw_step"), p, ties);
  if (!side_ops_) profiler_->step_done();  // (side ops: end_side_ops counts the step)
}
void CudaBackend::sgd_step(Tensor master, Tensor grad, Tensor momentum, Tensor model_param,
                           std::span<const OptimSegment> segments, const OptimStepParams& p) {
  on_device("sgd_step", master, grad, momentum, model_param);
  check_model_copy_segments(model_param, segments, "sgd_step");
  MT_PROFILE_OP("sgd_step {}", master.numel());
  cuda::sgd_step(context(), master, grad, momentum, model_param, segment_arg(segments, master.numel(), "sgd_step"), p);
  if (!side_ops_) profiler_->step_done();
}
void CudaBackend::sum_squares(Tensor out, Tensor x, std::span<const OptimSegment> segments, bool accumulate) {
  on_device("sum_squares", out, x);
  MT_PROFILE_OP("sum_squares {}", x.numel());
  cuda::sum_squares(context(), out, x, segment_arg(segments, x.numel(), "sum_squares"), accumulate);
}
void CudaBackend::count_zeros(Tensor out, Tensor x, std::span<const OptimSegment> segments, bool accumulate) {
  on_device("count_zeros", out, x);
  MT_PROFILE_OP("count_zeros {}", x.numel());
  cuda::count_zeros(context(), out, x, segment_arg(segments, x.numel(), "count_zeros"), accumulate);
}
void CudaBackend::hash_bytes(Tensor out, Tensor x) {
  on_device("hash_bytes", out, x);
  MT_PROFILE_OP("hash_bytes {}", x.nbytes());
  cuda::hash_bytes(context(), out, x);
}

std::unique_ptr<Backend> make_cuda_backend(int device_ordinal, bool gemm_autotune) {
  auto backend = std::make_unique<CudaBackend>(device_ordinal);
  backend->gemm().autotune = gemm_autotune;
  return backend;
}

}  // namespace mt

namespace mt {

// ---- grouped GEMMs (mixture of experts) -----------------------------------------------------------
void CudaBackend::prepare_grouped_gemms(int max_groups) {
  if (grouped_ && grouped_->max_groups() >= max_groups) return;
  if (grouped_) bytes_allocated_ -= grouped_->device_bytes();
  constexpr size_t kWorkspace = size_t{32} << 20;
  grouped_ = std::make_unique<cuda::GroupedGemm>(stream_, max_groups, kWorkspace);
  bytes_allocated_ += grouped_->device_bytes();
}

// Whether the grouped GEMM runner (prepare_grouped_gemms) takes an op of these experts; else the
// Backend's per-expert defaults run it.
bool CudaBackend::grouped_takes(const ExpertOffsets& offsets) const {
  return grouped_ && offsets.experts() <= grouped_->max_groups();
}

void CudaBackend::grouped_linear_forward(Tensor y, Tensor x, Tensor w, const ExpertOffsets& offsets) {
  if (!grouped_takes(offsets))
    return Backend::grouped_linear_forward(y, x, w, offsets);
  on_device("grouped_linear_forward", y, x, w);
  MT_PROFILE_OP("grouped_linear_forward {}x{}x{} ({} experts)", x.rows(), y.cols(), x.cols(), offsets.experts());
  grouped_->forward(y, x, w, offsets);
}

void CudaBackend::grouped_linear_backward_input(Tensor dx, Tensor dy, Tensor w, const ExpertOffsets& offsets) {
  if (!grouped_takes(offsets))
    return Backend::grouped_linear_backward_input(dx, dy, w, offsets);
  on_device("grouped_linear_backward_input", dx, dy, w);
  MT_PROFILE_OP("grouped_linear_backward_input {}x{}x{} ({} experts)", dy.rows(), dx.cols(), dy.cols(),
                offsets.experts());
  grouped_->backward_input(dx, dy, w, offsets);
}

void CudaBackend::grouped_linear_backward_weight(Tensor dw, Tensor dy, Tensor x, const ExpertOffsets& offsets,
                                                 bool accumulate, Tensor sumsq) {
  if (!grouped_takes(offsets))
    return Backend::grouped_linear_backward_weight(dw, dy, x, offsets, accumulate, sumsq);
  on_device("grouped_linear_backward_weight", dw, dy, x);
  MT_CHECK(sumsq.empty() || (!accumulate && sumsq.dtype == DType::f32 && sumsq.numel() == 1),
           "grouped_linear_backward_weight: the sum of squares of a gradient written (not added to), float32 [1]");
  if (!sumsq.empty()) on_device("grouped_linear_backward_weight", sumsq);
  MT_PROFILE_OP("grouped_linear_backward_weight {}x{}x{} ({} experts){}{}", dw.rows(), dw.cols(), dy.rows(),
                offsets.experts(), accumulate ? " +acc" : "", sumsq.empty() ? "" : " +sumsq");
  const bool took = grouped_->backward_weight(dw, dy, x, offsets, accumulate,
                                              sumsq.empty() ? nullptr : sumsq.ptr<float>());
  if (!sumsq.empty() && !took) sum_squares(sumsq, dw, {}, true);
}

}  // namespace mt

#include "engine/moe_routing.h"

namespace mt {

// Sinkhorn load balancing on a host copy of the logits (engine/moe_routing.h; the same code as the
// reference backend's, so both choose the same experts): the step waits for the logits, as it
// already waits for the experts' row counts.
void CudaBackend::moe_sinkhorn_route(Tensor probs, Tensor idx, Tensor logits, int topk, int64_t block_rows,
                                     bool training) {
  on_device("moe_sinkhorn_route", probs, idx, logits);
  const int64_t N = logits.rows(), E = logits.cols();
  check_sinkhorn_topk(topk, E);
  MT_CHECK(probs.dtype == DType::f32 && probs.numel() == N * topk && idx.dtype == DType::i32 &&
               idx.numel() == N * topk,
           "moe_sinkhorn_route: probs float32 and idx int32 [{}, {}]", N, topk);
  sinkhorn_raw_.resize(logits.nbytes());
  copy_to_host(sinkhorn_raw_.data(), logits);
  sinkhorn_z_.resize(static_cast<size_t>(N * E));
  for (int64_t i = 0; i < N * E; ++i) {
    const uint8_t* b = sinkhorn_raw_.data();
    double v = 0;
    switch (logits.dtype) {
      case DType::f32: v = reinterpret_cast<const float*>(b)[i]; break;
      case DType::bf16: v = bf16_bits_to_float(reinterpret_cast<const uint16_t*>(b)[i]); break;
      case DType::f16: v = f16_bits_to_float(reinterpret_cast<const uint16_t*>(b)[i]); break;
      default: fail("moe_sinkhorn_route: logits of dtype {}", dtype_name(logits.dtype));
    }
    sinkhorn_z_[static_cast<size_t>(i)] = v;
  }
  sinkhorn_p_.resize(static_cast<size_t>(N * topk));
  sinkhorn_p32_.resize(static_cast<size_t>(N * topk));
  sinkhorn_idx_.resize(static_cast<size_t>(N * topk));
  const DType dt = logits.dtype;
  moe_sinkhorn_route_host(sinkhorn_p_.data(), sinkhorn_idx_.data(), sinkhorn_z_.data(), N, static_cast<int>(E), topk,
                          block_rows, training, [dt](double v) {
                            const float f = static_cast<float>(v);
                            if (dt == DType::bf16) return static_cast<double>(bf16_bits_to_float(float_to_bf16_bits(f)));
                            if (dt == DType::f16) return static_cast<double>(f16_bits_to_float(float_to_f16_bits(f)));
                            return static_cast<double>(f);
                          });
  for (size_t i = 0; i < sinkhorn_p_.size(); ++i) sinkhorn_p32_[i] = static_cast<float>(sinkhorn_p_[i]);
  copy_from_host(probs, sinkhorn_p32_.data());
  copy_from_host(idx, sinkhorn_idx_.data());
  synchronize();  // (the staging is reused by the next call)
}

}  // namespace mt
