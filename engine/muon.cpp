#include "engine/muon.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <span>
#include <utility>

#include "core/error.h"
#include "engine/distributed_optimizer.h"
#include "parallel/communicator.h"

namespace mt {

namespace {

// emerging_optimizers 0.3's coefficient sets (muon_utils._COEFFICIENT_SETS), and whether the
// iteration repeats the last entry (else it cycles).
struct CoefficientSet {
  std::vector<MuonCoefficients> steps;
  bool repeat_last = false;
};

const std::map<std::string, CoefficientSet>& coefficient_sets() {
  static const std::map<std::string, CoefficientSet> sets = [] {
    std::map<std::string, CoefficientSet> s;
    s["simple"] = {{{3.4445f, -4.7750f, 2.0315f}}, false};
    s["quintic"] = {{{4.0848f, -6.8946f, 2.9270f},
                     {3.9505f, -6.3029f, 2.6377f},
                     {3.7418f, -5.5913f, 2.3037f},
                     {2.8769f, -3.1427f, 1.2046f},
                     {2.8366f, -3.0525f, 1.2012f}},
                    false};
    s["polar_express"] = {{{8.2051f, -22.9019f, 16.4607f},
                           {4.0664f, -2.8612f, 0.5184f},
                           {3.9096f, -2.8234f, 0.5250f},
                           {3.2856f, -2.4153f, 0.4853f},
                           {2.2779f, -1.6198f, 0.3985f},
                           {1.8726f, -1.2307f, 0.3585f},
                           {1.8564f, -1.2132f, 0.3568f},
                           {1.8750f, -1.2500f, 0.3750f}},
                          true};
    s["cans"] = {{{8.4703f, -25.1081f, 18.6293f},
                  {4.1828f, -3.1087f, 0.5806f},
                  {3.9619f, -2.9541f, 0.5630f},
                  {3.2866f, -2.4647f, 0.5074f},
                  {2.2737f, -1.6447f, 0.4162f}},
                 true};
    s["aol"] = {{{4.0098f, -7.0585f, 2.4635f},
                 {3.4585f, -5.5479f, 2.5959f},
                 {2.7573f, -3.2939f, 1.4254f},
                 {2.7215f, -3.0494f, 1.3169f}},
                false};
    CoefficientSet dsv4;
    dsv4.steps.assign(8, {3.4445f, -4.7750f, 2.0315f});
    dsv4.steps.insert(dsv4.steps.end(), 2, {2.0f, -1.5f, 0.5f});
    dsv4.repeat_last = true;
    s["deepseekv4"] = dsv4;
    return s;
  }();
  return sets;
}

constexpr double kNormEps = 1e-7;  // emerging_optimizers 0.3's newton_schulz eps

bool is_qkv_weight(const std::string& name) {
  const std::string suffix = "self_attention.linear_qkv.weight";
  return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The workspace's regions (elements of the master weights' dtype): the gathered matrix U, a
// staging area S (pieces, a column gather), then Newton-Schulz's own.
struct WorkspaceLayout {
  int64_t matrix = 0, stage = 0, ns = 0;
  int64_t total() const { return matrix + stage + ns; }
};

// Regions and the Newton-Schulz tensors start 256-byte aligned (GEMM operands): sizes in elements
// rounded up to kAlign (256 bytes of float32).
constexpr int64_t kAlign = 64;
int64_t aligned(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

WorkspaceLayout layout_of(const std::vector<MuonMatrix>& matrices, const MuonConfig& cfg) {
  WorkspaceLayout w;
  for (const MuonMatrix& m : matrices) {
    const int64_t rc = m.global_rows * m.global_cols;
    w.matrix = std::max(w.matrix, aligned(rc));
    w.stage = std::max(w.stage, aligned(std::max(rc, m.local_rows() * m.cols)));
    w.ns = std::max(w.ns, newton_schulz_workspace(m.global_rows, m.global_cols, cfg));
  }
  return w;
}

}  // namespace

bool muon_coefficients_known(const std::string& type) { return coefficient_sets().count(type) > 0; }

std::string muon_coefficient_types() {
  std::string out;
  for (const char* n : {"simple", "quintic", "polar_express", "cans", "aol", "deepseekv4"}) {
    if (!out.empty()) out += ", ";
    out += n;
  }
  return out;
}

std::vector<MuonCoefficients> muon_coefficients(const std::string& type, int steps) {
  const auto it = coefficient_sets().find(type);
  MT_CHECK(it != coefficient_sets().end(), "unknown Muon coefficient type {}", type);
  const CoefficientSet& s = it->second;
  std::vector<MuonCoefficients> out;
  for (int k = 0; k < steps; ++k) {
    const size_t n = s.steps.size(), i = static_cast<size_t>(k);
    out.push_back(s.repeat_last ? s.steps[std::min(i, n - 1)] : s.steps[i % n]);
  }
  return out;
}

bool muon_param(const ParamDesc& p) { return p.global_shape.size() == 2 && !p.decoupled_lr && !p.muon_excluded; }

double muon_scale(MuonScaleMode mode, int64_t rows, int64_t cols) {
  const double r = static_cast<double>(rows), c = static_cast<double>(cols);
  switch (mode) {
    case MuonScaleMode::shape_scaling: return std::sqrt(std::max(1.0, r / c));
    case MuonScaleMode::unit_rms_norm: return std::sqrt(r / c);
    case MuonScaleMode::spectral: break;
  }
  return std::sqrt(std::max(r, c));
}

std::vector<MuonMatrix> muon_matrices(const std::vector<ParamDesc>& params, const ModelDims& d, const MuonConfig& cfg) {
  const bool gather = cfg.tp_mode != MuonTpMode::blockwise;
  std::vector<MuonMatrix> out;
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamDesc& p = params[i];
    if (!muon_param(p)) continue;
    const int64_t lr = p.local_rows(), lc = p.local_cols();
    // Each routed expert alone; a parameter whole otherwise.
    const int64_t units = p.expert ? d.experts_local() : 1;
    const int64_t global_unit_rows = p.global_shape[0] / (p.expert ? d.experts : 1), unit_rows = lr / units;
    const int group = p.expert ? d.etp_size : d.tp_size;
    int dim = -1;
    if (unit_rows < global_unit_rows) dim = 0;
    else if (lc < p.global_shape[1]) dim = 1;
    if (dim >= 0 && p.expert && d.etp_size != d.tp_size)
      fail("megatrain does not support --optimizer muon with --expert-tensor-parallel-size {} under "
           "--tensor-model-parallel-size {} yet (Muon gathers the experts' shards over the TP group)", d.etp_size,
           d.tp_size);
    if (!gather) dim = -1;
    const int64_t gr = dim == 0 ? group : 1, gc = dim == 1 ? group : 1;
    if (cfg.split_qkv && is_qkv_weight(p.name) && !d.mla) {
      // Per local query group: [q | gate (--attention-output-gate) | k | v] rows of head_dim each.
      const int64_t dh = d.head_dim, q = static_cast<int64_t>(d.heads / d.groups) * dh;
      std::vector<int64_t> parts = {q};
      if (d.output_gate) parts.push_back(q);
      parts.push_back(dh);
      parts.push_back(dh);
      int64_t per_group = 0;
      for (int64_t s : parts) per_group += s;
      if (lr % per_group == 0) {
        const int pieces = static_cast<int>(lr / per_group);
        int64_t row0 = 0;
        for (int64_t s : parts) {
          out.push_back(MuonMatrix{static_cast<int>(i), row0, s, per_group, lc, pieces, dim, s * pieces * gr, lc * gc});
          row0 += s;
        }
        continue;
      }
    }
    for (int64_t u = 0; u < units; ++u)
      out.push_back(MuonMatrix{static_cast<int>(i), u * unit_rows, unit_rows, unit_rows, lc, 1, dim, unit_rows * gr,
                               lc * gc});
  }
  return out;
}

int64_t muon_workspace_elements(const std::vector<MuonMatrix>& matrices, const MuonConfig& cfg) {
  return matrices.empty() ? 0 : layout_of(matrices, cfg).total();
}

int64_t newton_schulz_workspace(int64_t rows, int64_t cols, const MuonConfig& cfg) {
  const int64_t m = std::min(rows, cols), n = rows * cols;
  // X's next value, A and A A (then b A + c A A), with bfloat16 rounding a 16-bit copy of the
  // largest of them (half as many elements of a 32-bit dtype, rounded up), and the norm's slot.
  // (Natively bfloat16: X, its next value, A and A A, in fewer bytes.)
  // Each of the four tensors starts aligned (up to kAlign elements of padding each).
  const int64_t rounding = cfg.fp32_matmul_prec == MuonMatmulPrecision::medium ? (std::max(n, m * m) + 1) / 2 : 0;
  return n + 2 * m * m + rounding + 1 + 4 * kAlign;
}

void newton_schulz(Backend& be, Tensor x, Tensor work, const MuonConfig& cfg) {
  const int64_t R = x.rows(), C = x.cols(), n = R * C;
  const bool transpose = R > C;  // orthogonalize over the smaller dimension
  const int64_t m = transpose ? C : R;
  MT_CHECK(work.dtype == x.dtype && work.numel() >= newton_schulz_workspace(R, C, cfg),
           "newton_schulz: workspace of {} elements for a [{}, {}] matrix", work.numel(), R, C);
  // Megatron-LM's "medium" precision: bfloat16 operands and results (float32 accumulation). A
  // backend with 16-bit GEMMs (CUDA) runs them on bfloat16 tensors; the reference backend on
  // float32 tensors rounded to bfloat16 after each product and each sum. The sums b A + c A A and
  // a X + P X (torch.addmm in emerging_optimizers) round twice on both: the product's bfloat16
  // value, then the sum's, as cuBLASLt does with a bfloat16 C. Both backends must round at the
  // same points: where the iteration nearly cancels (a X + P X of a matrix with equal singular
  // values), one product rounded differently moves the result by several bfloat16 steps.
  const bool medium = cfg.fp32_matmul_prec == MuonMatmulPrecision::medium;
  const bool native16 = medium && be.device() == Device::cuda;
  const DType dt = native16 ? DType::bf16 : x.dtype;
  char* const base = static_cast<char*>(work.data);
  size_t at = 0;
  const auto take = [&](int64_t rows, int64_t cols) {
    const Tensor t(base + at, dt, x.device, {rows, cols});
    at += static_cast<size_t>(aligned(rows * cols * static_cast<int64_t>(dtype_size(dt)) / 4 + 1)) * 4;
    return t;
  };
  const Tensor X = native16 ? take(R, C) : x, x2 = take(R, C), A = take(m, m), AA = take(m, m);
  void* const half_base = base + at;
  const auto round = [&](const Tensor& t) {
    if (!medium || native16) return;
    const Tensor h(half_base, DType::bf16, t.device, {t.numel()});
    be.cast(h, t);
    be.cast(t, h);
  };
  // X = x / max(|x|_F, eps).
  const Tensor slot = work.flat_slice(work.numel() - 1, 1);
  const OptimSegment whole{0, n, 0};
  be.sum_squares(slot, x, std::span<const OptimSegment>(&whole, 1), false);
  be.scale_by_rnorm(x, slot, static_cast<float>(kNormEps));
  if (native16) be.cast(X, x);
  round(X);
  const Tensor none;
  for (const MuonCoefficients& k : muon_coefficients(cfg.coefficient_type, cfg.num_ns_steps)) {
    const float a = k[0], b = k[1], c = k[2];
    // A = X X^T (X^T X when transposed).
    if (transpose) be.linear_backward_weight(A, none, X, X, false);
    else be.linear_forward(A, X, X, none, Activation::none, none);
    round(A);
    // P = b A + c A A, or b A alone for c = 0 (folded into the last sum).
    const Tensor& P = c != 0.0f ? AA : A;
    if (c != 0.0f) {
      be.linear_forward(AA, A, A, none, Activation::none, none);  // A A^T = A A (A symmetric)
      round(AA);
      be.axpby(AA, c, AA, b, A);
      round(AA);
    }
    // X = a X + P X (X P when transposed; P symmetric).
    if (transpose) be.linear_forward(x2, X, P, none, Activation::none, none);
    else be.linear_backward_input(x2, P, X, false, Activation::none, none);
    round(x2);
    be.axpby(X, a, X, c != 0.0f ? 1.0f : b, x2);
    round(X);
  }
  if (native16) be.cast(x, X);
}

namespace {
// The part [a, e) of parameter p's flat range [p.offset, p.offset + numel) inside range r's flat
// range, as offsets; false when they do not meet.
bool intersect(const ParamDesc& p, const MuonRange& r, int64_t& a, int64_t& e) {
  a = std::max(p.offset, r.flat_offset);
  e = std::min(p.offset + p.numel(), r.flat_offset + r.numel);
  return a < e;
}

// f(M) on elements [a, e) of the flat buffers (in r) as float32 master weights: M the master
// weights themselves, or, kept as remainders, their joined values in the workspace (in pieces of
// its size), split back into the parameters and remainders after f. Without remainders the
// compute-dtype parameters are cast from M afterwards where `cast` asks it.
void on_master(Backend& be, const MuonRange& r, Tensor workspace, int64_t a, int64_t e, bool cast,
               const std::function<void(Tensor M, int64_t from)>& f) {
  if (r.master.dtype != DType::i16) {
    const Tensor M = r.master.flat_slice(a - r.flat_offset, e - a);
    f(M, a);
    if (cast && !r.model_copy.empty()) be.cast(r.model_copy.flat_slice(a - r.flat_offset, e - a), M);
    return;
  }
  MT_CHECK(workspace.numel() > 0 && workspace.dtype == DType::f32, "Muon over master remainders: a float32 workspace");
  for (int64_t s = a; s < e; s += workspace.numel()) {
    const int64_t n = std::min(workspace.numel(), e - s), at = s - r.flat_offset;
    const Tensor M = workspace.flat_slice(0, n), w = r.model_copy.flat_slice(at, n), rem = r.master.flat_slice(at, n);
    const TieBits t = r.ties.empty() ? TieBits{} : TieBits{r.ties.words, r.ties.first + at};
    be.join_master(M, w, rem, t);
    f(M, s);
    be.split_master(w, rem, M, t);
  }
}
}  // namespace

void muon_momentum(Backend& be, const MuonConfig& cfg, const std::vector<ParamDesc>& params, const MuonViews& v,
                   const std::vector<MuonRange>& ranges, const std::vector<float>& lr, const std::vector<float>& wd,
                   float grad_scale) {
  for (const MuonRange& r : ranges) {
    const DType master = r.master.dtype == DType::i16 ? DType::f32 : r.master.dtype;  // (remainders: float32)
    MT_CHECK(v.grad.dtype == master, "Muon keeps its update in the gradient buffer: {} gradients, {} master weights",
             dtype_name(v.grad.dtype), dtype_name(master));
  }
  const float mu = static_cast<float>(cfg.momentum);
  for (size_t i = 0; i < params.size(); ++i) {
    if (!muon_param(params[i])) continue;
    for (const MuonRange& r : ranges) {
      int64_t a = 0, e = 0;
      if (!intersect(params[i], r, a, e)) continue;
      const Tensor B = r.momentum.flat_slice(a - r.flat_offset, e - a);
      const Tensor g = v.grad.flat_slice(a, e - a);
      // Decoupled weight decay first, then the momentum (on the clipped gradient), then Nesterov's.
      if (lr[i] * wd[i] != 0.0f)
        on_master(be, r, v.workspace, a, e, false, [&](Tensor M, int64_t) { be.axpby(M, 1.0f, M, -lr[i] * wd[i], M); });
      be.axpby(g, grad_scale, g, 0.0f, Tensor());
      be.axpby(B, mu, B, 1.0f - mu, g);
      if (cfg.nesterov) be.axpby(g, 1.0f - mu, g, mu, B);
      else be.copy(g, B);
    }
  }
}

void muon_orthogonalize(Backend& be, const MuonConfig& cfg, const std::vector<ParamDesc>& params,
                        const std::vector<MuonMatrix>& matrices, const std::vector<char>& owned, const MuonViews& v,
                        Communicator* tp) {
  if (matrices.empty()) return;
  MT_CHECK(owned.size() == matrices.size(), "muon_orthogonalize: {} ownership flags for {} matrices", owned.size(),
           matrices.size());
  const WorkspaceLayout w = layout_of(matrices, cfg);
  MT_CHECK(v.workspace.numel() >= w.total() && v.workspace.dtype == v.grad.dtype,
           "muon_orthogonalize: workspace of {} elements, {} needed", v.workspace.numel(), w.total());
  const Tensor U = v.workspace.flat_slice(0, w.matrix);
  const Tensor S = v.workspace.flat_slice(w.matrix, w.stage);
  const Tensor ns = v.workspace.flat_slice(w.matrix + w.stage, w.ns);
  const double extra = cfg.extra_scale_factor;
  for (size_t k = 0; k < matrices.size(); ++k) {
    const MuonMatrix& m = matrices[k];
    const ParamDesc& p = params[static_cast<size_t>(m.param)];
    // The parameter's update u (this TP rank's block) [rows, cols]; each matrix's rows of it are
    // read, then overwritten with their result (the matrices' rows are disjoint).
    const Tensor u = v.grad.flat_slice(p.offset, p.numel()).view({p.local_rows(), p.local_cols()});
    if (!owned[k]) {
      for (int g = 0; g < m.pieces; ++g) be.fill(u.row_slice(m.row0 + g * m.stride, m.rows), 0.0);
      continue;
    }
    const int64_t lrows = m.local_rows(), gr = m.global_rows, gc = m.global_cols;
    // This rank's part, contiguous.
    Tensor part = u.row_slice(m.row0, m.rows);
    if (m.pieces > 1) {
      part = S.flat_slice(0, lrows * m.cols).view({lrows, m.cols});
      for (int g = 0; g < m.pieces; ++g)
        be.copy(part.row_slice(g * m.rows, m.rows), u.row_slice(m.row0 + g * m.stride, m.rows));
    }
    // The whole matrix, in U.
    Communicator* const comm = tp;
    const Tensor full = U.flat_slice(0, gr * gc).view({gr, gc});
    if (m.shard_dim < 0) {
      be.copy(full, part);
    } else {
      MT_CHECK(comm != nullptr, "muon_orthogonalize: {} is sharded but no group gathers it", p.name);
      if (m.shard_dim == 0) {
        comm->all_gather(full, part);
      } else {
        MT_CHECK(m.pieces == 1, "muon_orthogonalize: {}: pieces of a column-sharded matrix", p.name);
        const Tensor stage = S.flat_slice(0, gr * gc);
        comm->all_gather(stage, part);
        for (int r = 0; r < comm->size(); ++r)
          be.copy_columns(full, r * m.cols, stage.flat_slice(r * lrows * m.cols, lrows * m.cols).view({lrows, m.cols}),
                          0, m.cols);
      }
    }
    newton_schulz(be, full, ns, cfg);
    // This rank's share of the orthogonalized matrix, scaled, over u's rows.
    Tensor own = full;
    if (m.shard_dim == 0) {
      own = full.row_slice(comm->rank() * lrows, lrows);
    } else if (m.shard_dim == 1) {
      own = S.flat_slice(0, lrows * m.cols).view({lrows, m.cols});
      be.copy_columns(own, 0, full, comm->rank() * m.cols, m.cols);
    }
    const float scale = static_cast<float>(muon_scale(cfg.scale_mode, gr, gc) * extra);
    for (int g = 0; g < m.pieces; ++g)
      be.axpby(u.row_slice(m.row0 + g * m.stride, m.rows), scale, own.row_slice(g * m.rows, m.rows), 0.0f, Tensor());
  }
}

void muon_apply(Backend& be, const std::vector<ParamDesc>& params, const MuonViews& v,
                const std::vector<MuonRange>& ranges, const std::vector<float>& lr) {
  for (size_t i = 0; i < params.size(); ++i) {
    if (!muon_param(params[i])) continue;
    for (const MuonRange& r : ranges) {
      int64_t a = 0, e = 0;
      if (!intersect(params[i], r, a, e)) continue;
      on_master(be, r, v.workspace, a, e, true, [&](Tensor M, int64_t from) {
        be.axpby(M, 1.0f, M, -lr[i], v.grad.flat_slice(from, M.numel()));
      });
    }
  }
}

std::vector<char> muon_owned(const std::vector<ParamDesc>& params, const std::vector<MuonMatrix>& matrices,
                             int dense_rank, int dense_size, int expert_rank, int expert_size) {
  std::vector<char> owned(matrices.size(), 0);
  int64_t dense = 0, expert = 0;  // matrices dealt so far in each group
  for (size_t k = 0; k < matrices.size(); ++k) {
    const bool is_expert = params[static_cast<size_t>(matrices[k].param)].expert;
    int64_t& n = is_expert ? expert : dense;
    const int size = is_expert ? expert_size : dense_size, rank = is_expert ? expert_rank : dense_rank;
    owned[k] = n++ % size == rank;
  }
  return owned;
}

std::vector<OptimSegment> without_muon_params(const std::vector<OptimSegment>& segments,
                                              const std::vector<ParamDesc>& params, int64_t flat_offset) {
  return without_params(segments, params, flat_offset, [](const ParamDesc& p) { return muon_param(p); });
}

}  // namespace mt
