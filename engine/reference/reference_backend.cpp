// ReferenceBackend: memory, transfers and the elementwise basics (fill, cast, axpby, init).
#include "engine/reference/reference_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/shard.h"
#include "engine/reference/tensor_access.h"

namespace mt {

std::unique_ptr<Backend> make_reference_backend(int num_threads) {
  return std::make_unique<reference::ReferenceBackend>(num_threads);
}

namespace reference {

ReferenceBackend::ReferenceBackend(int num_threads) : pool_(num_threads), scratch_(pool_.size()) {}

double* ReferenceBackend::scratch(int thread, size_t n) {
  auto& s = scratch_.at(static_cast<size_t>(thread));
  if (s.size() < n) s.resize(n);
  return s.data();
}

void* ReferenceBackend::allocate(size_t bytes) {
  // 64-byte alignment so that any dtype view of a sub-range stays aligned.
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
  if (!p) fail("reference backend: out of host memory allocating {} bytes", bytes);
  return p;
}

void ReferenceBackend::deallocate(void* p) { std::free(p); }

void ReferenceBackend::copy_from_host(Tensor dst, const void* host_src) {
  if (dst.nbytes()) std::memcpy(dst.data, host_src, dst.nbytes());
}

void ReferenceBackend::copy_to_host(void* host_dst, Tensor src) {
  if (src.nbytes()) std::memcpy(host_dst, src.data, src.nbytes());
}

void ReferenceBackend::copy(Tensor dst, Tensor src) {
  MT_CHECK(dst.dtype == src.dtype && dst.numel() == src.numel(), "copy {} <- {}", dst.shape_string(),
           src.shape_string());
  if (dst.data != src.data && dst.nbytes()) std::memmove(dst.data, src.data, dst.nbytes());
}

void ReferenceBackend::fill(Tensor t, double value) {
  const Floats f(t);
  if (t.dtype == DType::f32) {
    float* p = t.ptr<float>();
    std::fill(p, p + t.numel(), static_cast<float>(value));
    return;
  }
  for (int64_t i = 0; i < t.numel(); ++i) f.set(i, value);
}

void ReferenceBackend::cast(Tensor dst, Tensor src) {
  check_numel(dst, src.numel(), "cast", "dst");
  const Floats d(dst), s(src);
  pool_.parallel_for(src.numel(), 1 << 14, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) d.set(i, s.get(i));
  });
}

void ReferenceBackend::axpby(Tensor out, float alpha, Tensor a, float beta, Tensor b) {
  check_numel(a, out.numel(), "axpby", "a");
  if (!b.empty()) check_numel(b, out.numel(), "axpby", "b");
  const bool same = a.dtype == out.dtype && (b.empty() || b.dtype == out.dtype);
  if (same && (out.dtype == DType::f32 || out.dtype == DType::f64)) {
    dispatch_float(out, "axpby", [&](auto tag) {
      using T = decltype(tag);
      T* o = out.ptr<T>();
      const T* pa = a.ptr<T>();
      const T* pb = b.empty() ? nullptr : b.ptr<T>();
      const T al = static_cast<T>(alpha), be = static_cast<T>(beta);
      pool_.parallel_for(out.numel(), 1 << 14, [&](int64_t s, int64_t e, int) {
        for (int64_t i = s; i < e; ++i) o[i] = pb ? al * pa[i] + be * pb[i] : al * pa[i];
      });
    });
    return;
  }
  const Floats o(out), fa(a), fb(b);
  for (int64_t i = 0; i < out.numel(); ++i)
    o.set(i, static_cast<double>(alpha) * fa.get(i) + (fb.empty() ? 0.0 : static_cast<double>(beta) * fb.get(i)));
}

void ReferenceBackend::scale_by_rnorm(Tensor x, Tensor sumsq, float eps) {
  check_numel(sumsq, 1, "scale_by_rnorm", "sumsq");
  const float factor = 1.0f / std::max(static_cast<float>(std::sqrt(Floats(sumsq).get(0))), eps);
  dispatch_float(x, "scale_by_rnorm", [&](auto tag) {
    using T = decltype(tag);
    T* p = x.ptr<T>();
    pool_.parallel_for(x.numel(), 1 << 14, [&](int64_t s, int64_t e, int) {
      for (int64_t i = s; i < e; ++i) p[i] = static_cast<T>(p[i] * factor);
    });
  });
}

void ReferenceBackend::init_normal(Tensor t, uint64_t key, float std, const ShardIndex& index) {
  check_numel(t, index.local_numel(), "init_normal", "tensor");
  const Floats f(t);
  pool_.parallel_for(t.numel(), 1 << 12, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) {
      const uint64_t g = static_cast<uint64_t>(shard_global_index(index, i));
      const float v = std * normal_at(key, g);
      f.set(i, v);
    }
  });
}

void ReferenceBackend::init_uniform(Tensor t, uint64_t key, float lo, float hi, bool log_of, const ShardIndex& index) {
  check_numel(t, index.local_numel(), "init_uniform", "tensor");
  const Floats f(t);
  pool_.parallel_for(t.numel(), 1 << 12, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) {
      const float v = lo + (hi - lo) * uniform_at(key, static_cast<uint64_t>(shard_global_index(index, i)));
      f.set(i, log_of ? std::log(v) : v);
    }
  });
}

}  // namespace reference
}  // namespace mt
