#include "engine/replica_check.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "core/error.h"
#include "engine/backend.h"
#include "engine/gpt_model.h"
#include "parallel/communicator.h"
#include "parallel/parallel_state.h"

namespace mt {

namespace {

bool checked_by_test_mode(const std::string& name) {
  return name.find("self_attention.q_layernorm.") != std::string::npos ||
         name.find("self_attention.k_layernorm.") != std::string::npos;
}

double element(const uint8_t* p, DType t, int64_t i) {
  switch (t) {
    case DType::f64: {
      double v;
      std::memcpy(&v, p + i * 8, 8);
      return v;
    }
    case DType::f32: {
      float v;
      std::memcpy(&v, p + i * 4, 4);
      return v;
    }
    case DType::bf16: {
      uint16_t v;
      std::memcpy(&v, p + i * 2, 2);
      return bf16_bits_to_float(v);
    }
    case DType::f16: {
      uint16_t v;
      std::memcpy(&v, p + i * 2, 2);
      return f16_bits_to_float(v);
    }
    default:
      MT_CHECK(false, "replica check: unexpected parameter dtype");
      return 0;
  }
}

}  // namespace

ReplicaCheck::ReplicaCheck(ParallelState& ps, const std::vector<GptModel*>& chunks) : ps_(ps) {
  for (GptModel* m : chunks) {
    for (size_t i = 0; i < m->params().size(); ++i) {
      const ParamDesc& d = m->params()[i];
      if (!checked_by_test_mode(d.name)) continue;
      const Tensor t = m->param(static_cast<int>(i));
      if (params_.empty()) dtype_ = t.dtype;
      MT_CHECK(t.dtype == dtype_, "replica check: {} has another dtype than the other checked parameters", d.name);
      params_.push_back({d.name, t, numel_});
      numel_ += t.numel();
      be_ = &m->backend();
    }
  }
  if (params_.empty()) return;
  const size_t bytes = static_cast<size_t>(numel_) * dtype_size(dtype_);
  packed_ = be_->allocate(bytes);
  gathered_ = be_->allocate(bytes * static_cast<size_t>(std::max(ps.dp_size, ps.tp_size)));
}

ReplicaCheck::~ReplicaCheck() {
  if (packed_) be_->deallocate(packed_);
  if (gathered_) be_->deallocate(gathered_);
}

void ReplicaCheck::run() const {
  if (params_.empty()) return;
  const Tensor packed(packed_, dtype_, be_->device(), {numel_});
  for (const Param& p : params_) be_->copy(packed.flat_slice(p.offset, p.t.numel()), p.t);
  compare(*ps_.dp, "DP");
  compare(*ps_.tp, "TP");
}

void ReplicaCheck::compare(Communicator& group, const char* parallelism) const {
  const int n = group.size(), me = group.rank();
  if (n == 1) return;
  const Tensor packed(packed_, dtype_, be_->device(), {numel_});
  const Tensor gathered(gathered_, dtype_, be_->device(), {static_cast<int64_t>(n) * numel_});
  group.all_gather(gathered, packed);
  const size_t es = dtype_size(dtype_), row = static_cast<size_t>(numel_) * es;
  std::vector<uint8_t> host(row * static_cast<size_t>(n));
  be_->copy_to_host(host.data(), gathered);
  const uint8_t* mine = host.data() + row * static_cast<size_t>(me);
  for (int r = 0; r < n; ++r) {
    const uint8_t* theirs = host.data() + row * static_cast<size_t>(r);
    for (const Param& p : params_) {
      const size_t at = static_cast<size_t>(p.offset) * es, bytes = static_cast<size_t>(p.t.numel()) * es;
      if (std::memcmp(mine + at, theirs + at, bytes) == 0) continue;
      double sq = 0;
      for (int64_t i = 0; i < p.t.numel(); ++i) {
        const double d = element(theirs, dtype_, p.offset + i) - element(mine, dtype_, p.offset + i);
        sq += d * d;
      }
      fail("--test-mode: discrepancy between {} in {} ranks {} and {}. Diff: {:g}", p.name, parallelism, r, me,
           std::sqrt(sq));
    }
  }
}

}  // namespace mt
