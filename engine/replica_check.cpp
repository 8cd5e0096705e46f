#include "engine/replica_check.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/dtype.h"
#include "core/error.h"
#include "core/log.h"
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

namespace {

// A rank's verdict: its global rank, how many of its parameters' hashes differ from its DP rank 0's,
// the global rank of that DP rank 0, and how many parameters it holds.
constexpr int64_t kVerdict = 4;
constexpr int64_t kNamedParams = 16;  // "[Rank R] Hash not matching" lines per rank, at most
constexpr size_t kNamedRanks = 8;     // ranks the error message names, at most

}  // namespace

WeightHashCheck::WeightHashCheck(ParallelState& ps, const std::vector<GptModel*>& chunks) : ps_(ps) {
  if (chunks.empty()) return;
  dense_.comm = ps.dp.get();
  experts_.comm = &ps.expert_dp();
  for (size_t c = 0; c < chunks.size(); ++c) {
    const GptModel& m = *chunks[c];
    for (size_t i = 0; i < m.params().size(); ++i)
      (m.params()[i].expert ? experts_ : dense_)
          .params.push_back({m.params()[i].name, static_cast<int>(c), m.param(static_cast<int>(i))});
  }
  be_ = &chunks.front()->backend();
  for (Group* g : {&dense_, &experts_}) {
    if (g->params.empty()) continue;
    g->row = 1 + static_cast<int64_t>(g->params.size());
    const size_t row_bytes = static_cast<size_t>(g->row) * sizeof(int64_t);
    g->hashes = be_->allocate(row_bytes);
    g->gathered = be_->allocate(row_bytes * static_cast<size_t>(g->comm->size()));
    g->host.resize(static_cast<size_t>(g->row) * static_cast<size_t>(g->comm->size()));
  }
  verdict_ = be_->allocate(kVerdict * sizeof(int64_t));
  verdicts_ = be_->allocate(kVerdict * sizeof(int64_t) * static_cast<size_t>(ps.world_size));
  host_verdicts_.resize(static_cast<size_t>(kVerdict) * static_cast<size_t>(ps.world_size));
}

WeightHashCheck::~WeightHashCheck() {
  for (void* p : {dense_.hashes, dense_.gathered, experts_.hashes, experts_.gathered, verdict_, verdicts_})
    if (p) be_->deallocate(p);
}

int64_t WeightHashCheck::compare(Group& g, int64_t& first) {
  if (g.params.empty()) return 0;
  const Device dev = be_->device();
  const Tensor hashes(g.hashes, DType::i64, dev, {g.row});
  const int64_t me = ps_.rank;
  be_->copy_from_host(hashes.flat_slice(0, 1), &me);
  for (size_t i = 0; i < g.params.size(); ++i)
    be_->hash_bytes(hashes.flat_slice(1 + static_cast<int64_t>(i), 1), g.params[i].t);
  Communicator& comm = *g.comm;
  const Tensor gathered(g.gathered, DType::i64, dev, {static_cast<int64_t>(comm.size()) * g.row});
  if (comm.size() > 1) comm.all_gather(gathered, hashes);
  else be_->copy(gathered, hashes);
  be_->copy_to_host(g.host.data(), gathered);
  const int64_t* rank0 = g.host.data();  // the group's rank 0's row
  const int64_t* mine = rank0 + static_cast<size_t>(comm.rank()) * static_cast<size_t>(g.row);
  first = rank0[0];
  int64_t differing = 0;
  for (size_t i = 0; i < g.params.size(); ++i) {
    if (mine[1 + i] == rank0[1 + i]) continue;
    if (differing < kNamedParams)
      log::write_stderr(fmt::format("[Rank {}] Hash not matching for {} in model chunk{}", ps_.rank, g.params[i].name,
                                    g.params[i].chunk));
    ++differing;
  }
  if (differing > kNamedParams)
    log::write_stderr(fmt::format("[Rank {}] ... and {} more parameters whose hash does not match data-parallel rank "
                                  "0's", ps_.rank, differing - kNamedParams));
  return differing;
}

void WeightHashCheck::run(int64_t iteration) {
  if (!enabled()) return;
  const Device dev = be_->device();
  int64_t first = ps_.rank, expert_first = ps_.rank;
  const int64_t dense = compare(dense_, first), experts = compare(experts_, expert_first);
  const int64_t differing = dense + experts;
  if (dense == 0 && experts > 0) first = expert_first;  // (the rank the experts differ from)
  const int64_t held = static_cast<int64_t>(dense_.params.size() + experts_.params.size());

  // Every rank learns every group's verdict, so that all stop together with the same message.
  const int64_t verdict[kVerdict] = {ps_.rank, differing, first, held};
  const Tensor v(verdict_, DType::i64, dev, {kVerdict});
  const Tensor all(verdicts_, DType::i64, dev, {kVerdict * ps_.world_size});
  be_->copy_from_host(v, verdict);
  if (ps_.world_size > 1) ps_.world->all_gather(all, v);
  else be_->copy(all, v);
  be_->copy_to_host(host_verdicts_.data(), all);
  std::vector<std::string> differ;
  size_t ranks = 0;
  for (int r = 0; r < ps_.world_size; ++r) {
    const int64_t* w = host_verdicts_.data() + static_cast<size_t>(r) * kVerdict;
    if (w[1] == 0) continue;
    if (++ranks <= kNamedRanks)
      differ.push_back(fmt::format("rank {}'s weights differ from rank {}'s (data-parallel rank 0 of its group) in {} "
                                   "of {} parameters", w[0], w[2], w[1], w[3]));
  }
  if (ranks > kNamedRanks) differ.push_back(fmt::format("and {} more ranks", ranks - kNamedRanks));
  if (differ.empty()) {
    log::info(">>> Weight hashes match after {} iterations...", iteration);
    return;
  }
  std::string list;
  for (const std::string& d : differ) list += (list.empty() ? "" : "; ") + d;
  fail("Parameter hashes not matching across DP replicas after {} iterations: {} (the \"Hash not matching\" lines "
       "name the parameters)", iteration, list);
}

}  // namespace mt
