// ReferenceBackend: AdamW and SGD steps on flat buffers, the reductions used for the grad norm and
// --log-num-zeros-in-grad, and the byte hash of the weight hash check.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>

#include "core/byte_hash.h"
#include "core/master_remainder.h"
#include "engine/reference/reference_backend.h"
#include "engine/reference/tensor_access.h"

namespace mt::reference {

namespace {
constexpr int64_t kBlock = 1 << 12;  // reduction block: partial sums per block, then in order

// The gradient is in the master weights' type, or bf16 (--grad-reduce-in-bf16: read as float).
void check_optimizer_grad(const Tensor& master, const Tensor& grad, const char* op) {
  if (grad.dtype != DType::bf16) check_same_dtype(master, grad, op);
}

// Adam's moments: in the master weights' type, or bf16 (--exp-avg-dtype / --exp-avg-sq-dtype bf16:
// read as float, stored rounded to nearest even).
void check_moment(const Tensor& master, const Tensor& moment, const char* name) {
  MT_CHECK(moment.dtype == master.dtype || moment.dtype == DType::bf16, "adamw_step: {} is {} with {} master weights",
           name, dtype_name(moment.dtype), dtype_name(master.dtype));
}

// Where an update writes its new master weights: the compute-dtype model copy (one rounding), or
// an FP8 one (OptimSegment::fp8_scale: fp8_quantize's cast of the float32 value). A segment with an
// amax (OptimSegment::fp8_amax) also gets max |new weight| as its next FP8 cast reads it, once per
// block of the segment: the stored value of a compute-dtype copy, else the value itself.
class ModelCopy {
 public:
  ModelCopy(const Tensor& model, const OptimSegment& s, const char* op) : out_(model), s_(s) {
    fp8_ = !model.empty() && is_fp8(model.dtype);
    MT_CHECK(!fp8_ || (model.dtype == DType::fp8_e4m3 && s.fp8_scale && s.fp8_amax),
             "{}: an FP8 model copy needs e4m3 and every segment's fp8_scale and fp8_amax", op);
    MT_CHECK(fp8_ || !s.fp8_scale, "{}: a segment with an FP8 scale, but a {} model copy", op, dtype_name(model.dtype));
  }
  void set(int64_t i, float value, float& block_amax) const {
    float read = value;  // what the weight's next cast reads
    if (fp8_) {
      static_cast<uint8_t*>(out_.p)[i] = float_to_fp8_bits(DType::fp8_e4m3, value * *s_.fp8_scale);
    } else if (!out_.empty()) {
      out_.set(i, value);
      read = static_cast<float>(out_.get(i));
    }
    if (s_.fp8_amax) block_amax = std::max(block_amax, std::fabs(read));
  }
  void finish_block(float block_amax) const {
    if (!s_.fp8_amax) return;
    const std::lock_guard<std::mutex> lock(mutex_);
    *s_.fp8_amax = std::max(*s_.fp8_amax, block_amax);
  }

 private:
  Floats out_;
  const OptimSegment& s_;
  bool fp8_ = false;
  mutable std::mutex mutex_;
};

// One AdamW element (Apex/Transformer Engine FusedAdam, adam_w_mode) in double: moments m and v at
// element i updated with the scaled gradient gi, and the new master weight returned (unrounded).
struct AdamMath {
  double b1, b2, bc1, bc2;
  explicit AdamMath(const OptimStepParams& p)
      : b1(p.beta1), b2(p.beta2), bc1(1.0 - std::pow(b1, static_cast<double>(p.step))),
        bc2(1.0 - std::pow(b2, static_cast<double>(p.step))) {}
  double step(const Floats& m, const Floats& v, int64_t i, double gi, double w, double lr, double wd,
              double eps) const {
    const double mi = b1 * m.get(i) + (1.0 - b1) * gi;
    const double vi = b2 * v.get(i) + (1.0 - b2) * gi * gi;
    m.set(i, mi);
    v.set(i, vi);
    const double update = (mi / bc1) / (std::sqrt(vi / bc2) + eps) + wd * w;
    return w - lr * update;
  }
};

// Float32 master weights kept as int16 remainders beside bf16 weights (core/master_remainder.h),
// element by element: rounded ties away, or to nearest even with tie bits (TieBits; other threads
// write other bits of a word at the same time, so a bit that changes is flipped atomically).
class Remainders {
 public:
  Remainders(Tensor model, Tensor remainder, TieBits ties, const char* op)
      : w16_(model.ptr<uint16_t>()), rem_(remainder.ptr<int16_t>()), ties_(ties) {
    MT_CHECK(model.dtype == DType::bf16, "{}: int16 master remainders need a bf16 model copy, got {}", op,
             model.empty() ? std::string_view("none") : dtype_name(model.dtype));
    MT_CHECK(remainder.dtype == DType::i16, "{}: remainder is {}, not int16", op, dtype_name(remainder.dtype));
    check_numel(model, remainder.numel(), op, "model_param");
    MT_CHECK(ties.empty() || (ties.words.dtype == DType::i32 && ties.first >= 0 &&
                              (ties.first + remainder.numel() + 31) / 32 <= ties.words.numel()),
             "{}: tie bits for {} elements from bit {} in {} int32 words", op, remainder.numel(), ties.first,
             ties.words.numel());
  }
  float get(int64_t i) const {
    if (ties_.empty()) return join_master_bits(w16_[i], rem_[i]);
    return join_master_even(w16_[i], rem_[i], bit(ties_.first + i));
  }
  void set(int64_t i, float x) const {
    if (ties_.empty()) {
      const SplitMaster s = split_master_bits(x);
      w16_[i] = s.weight;
      rem_[i] = s.remainder;
      return;
    }
    const SplitMasterEven s = split_master_even(x);
    w16_[i] = s.weight;
    rem_[i] = s.remainder;
    const int64_t b = ties_.first + i;
    if (bit(b) != s.up) word(b).fetch_xor(1u << (b & 31), std::memory_order_relaxed);
  }
  uint16_t weight(int64_t i) const { return w16_[i]; }

 private:
  // (Relaxed atomics: neighbours' bits in the same word change on other threads meanwhile.)
  std::atomic_ref<uint32_t> word(int64_t b) const { return std::atomic_ref<uint32_t>(ties_.words.ptr<uint32_t>()[b >> 5]); }
  bool bit(int64_t b) const { return ((word(b).load(std::memory_order_relaxed) >> (b & 31)) & 1u) != 0; }
  uint16_t* w16_;
  int16_t* rem_;
  TieBits ties_;
};

// AdamW over float32 master weights kept as remainders: each element's master weight is joined,
// updated as adamw_step's, and split back.
void adamw_step_remainders(ThreadPool& pool, Tensor remainder, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq,
                           Tensor model, std::span<const OptimSegment> segments, const OptimStepParams& p,
                           TieBits ties) {
  const Remainders master(model, remainder, ties, "adamw_step");
  const Floats fg(grad), m(exp_avg), v(exp_avg_sq);
  const AdamMath adam(p);
  for_each_segment(remainder, segments, [&](const OptimSegment& s) {
    MT_CHECK(s.group >= 0 && s.group < OptimStepParams::kMaxGroups, "segment group {}", s.group);
    MT_CHECK(!s.fp8_scale, "adamw_step: an FP8 segment with int16 master remainders");
    const double lr = p.lr[s.group], wd = p.weight_decay[s.group], eps = p.eps_of(s.group);
    float block_max = 0.0f;
    std::mutex amax_mutex;
    pool.parallel_for(s.count, kBlock, [&](int64_t b, int64_t e, int) {
      float amax = 0.0f;
      for (int64_t i = s.offset + b; i < s.offset + e; ++i) {
        const double next = adam.step(m, v, i, fg.get(i) * p.grad_scale, master.get(i), lr, wd, eps);
        master.set(i, static_cast<float>(next));
        amax = std::max(amax, std::fabs(bf16_bits_to_float(master.weight(i))));
      }
      if (!s.fp8_amax) return;
      const std::lock_guard<std::mutex> lock(amax_mutex);
      block_max = std::max(block_max, amax);
    });
    if (s.fp8_amax) *s.fp8_amax = std::max(*s.fp8_amax, block_max);
  });
}
}  // namespace

void ReferenceBackend::split_master(Tensor model, Tensor remainder, Tensor master, TieBits ties) {
  const int64_t n = master.numel();
  MT_CHECK(master.dtype == DType::f32, "split_master: master is {}, not float32", dtype_name(master.dtype));
  MT_CHECK(model.dtype == DType::bf16, "split_master: model is {}, not bf16", dtype_name(model.dtype));
  check_numel(model, n, "split_master", "model");
  const float* x = master.ptr<float>();
  if (remainder.empty()) {  // the weights alone
    uint16_t* w = model.ptr<uint16_t>();
    MT_CHECK(ties.empty(), "split_master: tie bits without remainders");
    pool_.parallel_for(n, 1 << 14, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) w[i] = split_master_bits(x[i]).weight;
    });
    return;
  }
  check_numel(remainder, n, "split_master", "remainder");
  const Remainders out(model, remainder, ties, "split_master");
  pool_.parallel_for(n, 1 << 14, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) out.set(i, x[i]);
  });
}

void ReferenceBackend::join_master(Tensor master, Tensor model, Tensor remainder, TieBits ties) {
  const int64_t n = remainder.numel();
  MT_CHECK(master.dtype == DType::f32, "join_master: master is {}, not float32", dtype_name(master.dtype));
  check_numel(master, n, "join_master", "master");
  const Remainders in(model, remainder, ties, "join_master");
  float* x = master.ptr<float>();
  pool_.parallel_for(n, 1 << 14, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) x[i] = in.get(i);
  });
}

void ReferenceBackend::adamw_step(Tensor master, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq,
                                  Tensor model_param, std::span<const OptimSegment> segments,
                                  const OptimStepParams& p, TieBits ties) {
  const int64_t n = master.numel();
  check_numel(grad, n, "adamw_step", "grad");
  check_numel(exp_avg, n, "adamw_step", "exp_avg");
  check_numel(exp_avg_sq, n, "adamw_step", "exp_avg_sq");
  if (!model_param.empty()) check_numel(model_param, n, "adamw_step", "model_param");
  MT_CHECK(p.step >= 1, "adamw_step: step {} (1-based)", p.step);
  if (master.dtype == DType::i16) {
    for (const Tensor* t : {&exp_avg, &exp_avg_sq})
      MT_CHECK(t->dtype == DType::f32 || t->dtype == DType::bf16, "adamw_step: {} moments with int16 master remainders",
               dtype_name(t->dtype));
    MT_CHECK(grad.dtype == DType::f32 || grad.dtype == DType::bf16, "adamw_step: {} gradients with int16 master "
             "remainders", dtype_name(grad.dtype));
    return adamw_step_remainders(pool_, master, grad, exp_avg, exp_avg_sq, model_param, segments, p, ties);
  }
  MT_CHECK(ties.empty(), "adamw_step: tie bits with {} master weights", dtype_name(master.dtype));
  check_optimizer_grad(master, grad, "adamw_step");
  check_moment(master, exp_avg, "exp_avg");
  check_moment(master, exp_avg_sq, "exp_avg_sq");
  const Floats fg(grad);
  const bool grad_wide = grad.dtype == master.dtype;
  const AdamMath adam(p);
  dispatch_float(master, "adamw_step", [&](auto tag) {
    using T = decltype(tag);
    T* w = master.ptr<T>();
    const T* g = grad_wide ? grad.ptr<T>() : nullptr;
    const Floats m(exp_avg), v(exp_avg_sq);
    for_each_segment(master, segments, [&](const OptimSegment& s) {
      MT_CHECK(s.group >= 0 && s.group < OptimStepParams::kMaxGroups, "segment group {}", s.group);
      const double lr = p.lr[s.group], wd = p.weight_decay[s.group], eps = p.eps_of(s.group);
      const ModelCopy mp(model_param, s, "adamw_step");
      pool_.parallel_for(s.count, kBlock, [&](int64_t b, int64_t e, int) {
        float amax = 0.0f;
        for (int64_t i = s.offset + b; i < s.offset + e; ++i) {
          const double gi = (grad_wide ? static_cast<double>(g[i]) : fg.get(i)) * p.grad_scale;
          w[i] = static_cast<T>(adam.step(m, v, i, gi, static_cast<double>(w[i]), lr, wd, eps));
          mp.set(i, static_cast<float>(w[i]), amax);
        }
        mp.finish_block(amax);
      });
    });
  });
}

void ReferenceBackend::sgd_step(Tensor master, Tensor grad, Tensor momentum, Tensor model_param,
                                std::span<const OptimSegment> segments, const OptimStepParams& p) {
  const int64_t n = master.numel();
  check_numel(grad, n, "sgd_step", "grad");
  if (!momentum.empty()) check_numel(momentum, n, "sgd_step", "momentum");
  if (!model_param.empty()) check_numel(model_param, n, "sgd_step", "model_param");
  check_optimizer_grad(master, grad, "sgd_step");
  check_same_dtype(master, momentum, "sgd_step");
  const Floats fg(grad);
  const bool grad_wide = grad.dtype == master.dtype;
  dispatch_float(master, "sgd_step", [&](auto tag) {
    using T = decltype(tag);
    T* w = master.ptr<T>();
    const T* g = grad_wide ? grad.ptr<T>() : nullptr;
    T* buf = momentum.empty() ? nullptr : momentum.ptr<T>();
    const double mom = p.sgd_momentum;
    for_each_segment(master, segments, [&](const OptimSegment& s) {
      MT_CHECK(s.group >= 0 && s.group < OptimStepParams::kMaxGroups, "segment group {}", s.group);
      const double lr = p.lr[s.group], wd = p.weight_decay[s.group];
      const ModelCopy mp(model_param, s, "sgd_step");
      pool_.parallel_for(s.count, kBlock, [&](int64_t b, int64_t e, int) {
        float amax = 0.0f;
        for (int64_t i = s.offset + b; i < s.offset + e; ++i) {
          // SGD's weight decay is L2 (added to the gradient), as torch.optim.SGD / apex FusedSGD.
          double d = (grad_wide ? static_cast<double>(g[i]) : fg.get(i)) * p.grad_scale + wd * w[i];
          if (buf && mom != 0.0) {
            d = mom * buf[i] + d;  // buf starts at 0, so the first step stores the gradient
            buf[i] = static_cast<T>(d);
          }
          w[i] = static_cast<T>(w[i] - lr * d);
          mp.set(i, static_cast<float>(w[i]), amax);
        }
        mp.finish_block(amax);
      });
    });
  });
}

namespace {

// Sum of f(x[i]) over the segments, in a fixed order: fixed-size blocks summed in parallel, then
// the block sums in order (independent of the thread count).
template <typename F>
double reduce_segments(ReferenceBackend& be, const Tensor& x, std::span<const OptimSegment> segments, F&& f) {
  double total = 0;
  for_each_segment(x, segments, [&](const OptimSegment& s) {
    const int64_t blocks = (s.count + kBlock - 1) / kBlock;
    if (blocks == 0) return;
    double* partial = be.scratch(0, static_cast<size_t>(blocks));
    be.pool().parallel_for(blocks, 1, [&](int64_t bb, int64_t be_, int) {
      for (int64_t blk = bb; blk < be_; ++blk) {
        const int64_t b = s.offset + blk * kBlock, e = std::min(s.offset + s.count, b + kBlock);
        double acc = 0;
        for (int64_t i = b; i < e; ++i) acc += f(i);
        partial[blk] = acc;
      }
    });
    for (int64_t blk = 0; blk < blocks; ++blk) total += partial[blk];
  });
  return total;
}

}  // namespace

void ReferenceBackend::sum_squares(Tensor out, Tensor x, std::span<const OptimSegment> segments, bool accumulate) {
  check_numel(out, 1, "sum_squares", "out");
  const Floats o(out), fx(x);
  double total = 0;
  if (x.dtype == DType::f32 || x.dtype == DType::f64) {
    dispatch_float(x, "sum_squares", [&](auto tag) {
      using T = decltype(tag);
      const T* p = x.ptr<T>();
      total = reduce_segments(*this, x, segments, [p](int64_t i) { return static_cast<double>(p[i]) * p[i]; });
    });
  } else {
    total = reduce_segments(*this, x, segments, [&fx](int64_t i) { return fx.get(i) * fx.get(i); });
  }
  if (accumulate) o.add(0, total);
  else o.set(0, total);
}

void ReferenceBackend::master_sum_squares(Tensor out, Tensor model, Tensor remainder, TieBits ties,
                                          std::span<const OptimSegment> segments, bool accumulate) {
  check_numel(out, 1, "master_sum_squares", "out");
  MT_CHECK(!ties.empty(), "master_sum_squares: the master weights' tie bits");
  const Remainders master(model, remainder, ties, "master_sum_squares");
  const Floats o(out);
  // (As sum_squares over a float32 buffer of the joined values.)
  const double total = reduce_segments(*this, remainder, segments, [&master](int64_t i) {
    const float x = master.get(i);
    return static_cast<double>(x) * x;
  });
  if (accumulate) o.add(0, total);
  else o.set(0, total);
}

void ReferenceBackend::count_zeros(Tensor out, Tensor x, std::span<const OptimSegment> segments, bool accumulate) {
  check_numel(out, 1, "count_zeros", "out");
  const Floats o(out), fx(x);
  const double total = reduce_segments(*this, x, segments, [&fx](int64_t i) { return fx.get(i) == 0.0 ? 1.0 : 0.0; });
  if (accumulate) o.add(0, total);
  else o.set(0, total);
}

void ReferenceBackend::hash_bytes(Tensor out, Tensor x) {
  MT_CHECK(out.dtype == DType::i64 && out.numel() == 1, "hash_bytes: out must be int64 [1], got {} {}",
           dtype_name(out.dtype), out.shape_string());
  const uint64_t h = byte_hash(x.data, x.empty() ? 0 : x.nbytes());
  std::memcpy(out.data, &h, sizeof h);
}

}  // namespace mt::reference
