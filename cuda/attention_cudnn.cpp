#include "cuda/attention_cudnn.h"

#include <cudnn.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "core/log.h"
#include "cuda/attention.h"
#include "cuda/attention_kv_heads.h"
#include "cuda/cuda_check.h"

namespace mt::cuda::cudnn_attention {
namespace {

// ---- thin RAII layer over the backend API ----------------------------------------------------

struct CudnnFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void check(cudnnStatus_t status, const char* what) {
  if (status == CUDNN_STATUS_SUCCESS) return;
  char detail[1024] = {};
  cudnnGetLastErrorString(detail, sizeof detail);
  throw CudnnFailure(fmt::format("{}: {} {}", what, cudnnGetErrorString(status), detail));
}

class Descriptor {
 public:
  explicit Descriptor(cudnnBackendDescriptorType_t type) {
    check(cudnnBackendCreateDescriptor(type, &d_), "cudnnBackendCreateDescriptor");
  }
  ~Descriptor() {
    if (d_) cudnnBackendDestroyDescriptor(d_);
  }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
  cudnnBackendDescriptor_t get() const { return d_; }

  Descriptor& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count, const void* value) {
    const cudnnStatus_t st = cudnnBackendSetAttribute(d_, name, type, count, value);
    if (st != CUDNN_STATUS_SUCCESS)
      check(st, fmt::format("cudnnBackendSetAttribute(attribute {})", static_cast<int>(name)).c_str());
    return *this;
  }
  template <typename T>
  Descriptor& set1(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, T value) {
    return set(name, type, 1, &value);
  }
  Descriptor& set_desc(cudnnBackendAttributeName_t name, const Descriptor& other) {
    cudnnBackendDescriptor_t h = other.get();
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &h);
  }
  void finalize(const std::string& what) { check(cudnnBackendFinalize(d_), what.c_str()); }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

// Fixed ids of the tensors we bind at execution; virtual tensors are numbered from kFirstVirtual.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kScale, kNegInf, kDeltaScale, kdO, kdQ, kdK, kdV, kSoftmaxSum, kdQAccum, kWindowBound,
  kWindowNegInf, kSeed, kOffset, kDropoutScale,
  kFirstVirtual = 100
};

struct TensorRef {
  const Descriptor* desc = nullptr;
  std::vector<int64_t> dims, strides;
};

// Builds an operation graph from tensors and operations, keeping every descriptor alive.
class GraphBuilder {
 public:
  TensorRef tensor(std::vector<int64_t> dims, std::vector<int64_t> strides, cudnnDataType_t type, bool is_virtual,
                   int64_t uid = 0, bool by_value = false) {
    auto& d = own(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    if (uid == 0) uid = next_virtual_++;
    const int64_t alignment = 16;
    d.set1(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, type)
        .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, static_cast<int64_t>(dims.size()), dims.data())
        .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, static_cast<int64_t>(strides.size()), strides.data())
        .set1(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, uid)
        .set1(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, alignment);
    if (is_virtual) d.set1(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, true);
    if (by_value) d.set1(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, true);
    d.finalize(fmt::format("tensor {}", uid));
    return {&d, std::move(dims), std::move(strides)};
  }
  TensorRef bound(std::vector<int64_t> dims, std::vector<int64_t> strides, cudnnDataType_t type, int64_t uid) {
    return tensor(std::move(dims), std::move(strides), type, false, uid);
  }
  TensorRef scalar(int64_t uid) { return tensor({1, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_FLOAT, false, uid, true); }
  TensorRef virt(std::vector<int64_t> dims, std::vector<int64_t> strides, cudnnDataType_t type = CUDNN_DATA_FLOAT) {
    return tensor(std::move(dims), std::move(strides), type, true);
  }

  // y = op(x [, b [, t]]) with y virtual: broadcast dims, strides of the input that has them.
  TensorRef pointwise(cudnnPointwiseMode_t mode, const TensorRef& x, const TensorRef* b = nullptr,
                      const TensorRef* t = nullptr, cudnnDataType_t out_type = CUDNN_DATA_FLOAT,
                      cudnnDataType_t compute = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    std::vector<int64_t> dims = x.dims;
    if (b)
      for (size_t i = 0; i < dims.size(); ++i) dims[i] = std::max(dims[i], b->dims[i]);
    std::vector<int64_t> strides;
    if (x.dims == dims) strides = x.strides;
    else if (b && b->dims == dims) strides = b->strides;
    else strides = packed(dims);
    TensorRef y = virt(dims, strides, out_type);
    pointwise_into(mode, x, b, t, y, compute, axis);
    return y;
  }
  void pointwise_into(cudnnPointwiseMode_t mode, const TensorRef& x, const TensorRef* b, const TensorRef* t,
                      const TensorRef& y, cudnnDataType_t compute = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    auto& pw = own(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    pw.set1(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, mode)
        .set1(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, compute);
    if (mode == CUDNN_POINTWISE_GEN_INDEX) pw.set1(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, axis);
    pw.finalize("pointwise descriptor");
    auto& op = own(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw)
        .set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, *x.desc)
        .set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, *y.desc);
    if (b) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *b->desc);
    if (t) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, *t->desc);
    op.set1(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1.0f)
        .set1(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1.0f);
    op.finalize(fmt::format("pointwise operation (mode {})", static_cast<int>(mode)));
    ops_.push_back(&op);
  }
  // Row reduction over the last dim into y [b, h, s, 1].
  void reduce_into(cudnnReduceTensorOp_t mode, const TensorRef& x, const TensorRef& y) {
    auto& red = own(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    red.set1(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, mode)
        .set1(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, CUDNN_DATA_FLOAT);
    if (cudnnGetVersion() >= 91100) red.set1(CUDNN_ATTR_REDUCTION_IS_DETERMINISTIC, CUDNN_TYPE_BOOLEAN, false);
    red.finalize("reduction descriptor");
    auto& op = own(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, red)
        .set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, *x.desc)
        .set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, *y.desc);
    op.finalize("reduction operation");
    ops_.push_back(&op);
  }
  void matmul(const TensorRef& a, const TensorRef& b, const TensorRef& c) {
    auto& mm = own(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    mm.set1(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, CUDNN_DATA_FLOAT);
    mm.finalize("matmul descriptor");
    auto& op = own(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, *a.desc)
        .set_desc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, *b.desc)
        .set_desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, *c.desc)
        .set_desc(CUDNN_ATTR_OPERATION_MATMUL_DESC, mm);
    op.finalize("matmul operation");
    ops_.push_back(&op);
  }
  TensorRef reshape(const TensorRef& x, std::vector<int64_t> dims, std::vector<int64_t> strides, cudnnDataType_t type) {
    TensorRef y = virt(std::move(dims), std::move(strides), type);
    auto& op = own(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, *x.desc).set_desc(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, *y.desc);
    op.finalize("reshape operation");
    ops_.push_back(&op);
    return y;
  }
  // Top-left causal mask: scores of key > query become -inf.
  TensorRef causal_mask(const TensorRef& scores, const TensorRef& neg_inf) {
    const TensorRef row = pointwise(CUDNN_POINTWISE_GEN_INDEX, scores, nullptr, nullptr, CUDNN_DATA_INT32,
                                    CUDNN_DATA_FLOAT, 2);
    const TensorRef col = pointwise(CUDNN_POINTWISE_GEN_INDEX, scores, nullptr, nullptr, CUDNN_DATA_INT32,
                                    CUDNN_DATA_FLOAT, 3);
    const TensorRef keep = pointwise(CUDNN_POINTWISE_CMP_GE, row, &col, nullptr, CUDNN_DATA_BOOLEAN, CUDNN_DATA_BOOLEAN);
    return pointwise(CUDNN_POINTWISE_BINARY_SELECT, scores, &neg_inf, &keep);
  }
  // Sliding window, after the causal mask: scores of key + bound <= query become -inf, so a query
  // keeps `bound` keys (itself included). The graph cudnn-frontend builds for
  // set_diagonal_band_left_bound (top-left aligned), which cuDNN's fused engines recognise.
  TensorRef window_mask(const TensorRef& scores, const TensorRef& bound, const TensorRef& neg_inf) {
    const TensorRef row = pointwise(CUDNN_POINTWISE_GEN_INDEX, scores, nullptr, nullptr, CUDNN_DATA_INT32,
                                    CUDNN_DATA_FLOAT, 2);
    const TensorRef col = pointwise(CUDNN_POINTWISE_GEN_INDEX, scores, nullptr, nullptr, CUDNN_DATA_INT32,
                                    CUDNN_DATA_FLOAT, 3);
    const TensorRef shifted = pointwise(CUDNN_POINTWISE_ADD, col, &bound, nullptr, CUDNN_DATA_FLOAT, CUDNN_DATA_FLOAT);
    const TensorRef keep = pointwise(CUDNN_POINTWISE_CMP_GT, shifted, &row, nullptr, CUDNN_DATA_BOOLEAN, CUDNN_DATA_BOOLEAN);
    return pointwise(CUDNN_POINTWISE_BINARY_SELECT, scores, &neg_inf, &keep);
  }
  // Dropout's keep mask [b, h, s, s] (1 kept, with probability `keep`), drawn by cuDNN's Philox
  // from the int64 device scalars kSeed and kOffset: the RNG operation cudnn-frontend puts into
  // its SDPA graphs, which the fused engines regenerate in the backward from the same seed.
  TensorRef dropout_mask(std::vector<int64_t> dims, std::vector<int64_t> strides, double keep) {
    const TensorRef seed = bound({1, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_INT64, kSeed);
    const TensorRef offset = bound({1, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_INT64, kOffset);
    TensorRef y = virt(std::move(dims), std::move(strides));
    auto& rng = own(CUDNN_BACKEND_RNG_DESCRIPTOR);
    rng.set1(CUDNN_ATTR_RNG_DISTRIBUTION, CUDNN_TYPE_RNG_DISTRIBUTION, CUDNN_RNG_DISTRIBUTION_BERNOULLI)
        .set1(CUDNN_ATTR_RNG_BERNOULLI_DIST_PROBABILITY, CUDNN_TYPE_DOUBLE, keep);
    rng.finalize("rng descriptor");
    auto& op = own(CUDNN_BACKEND_OPERATION_RNG_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_RNG_YDESC, *y.desc)
        .set_desc(CUDNN_ATTR_OPERATION_RNG_DESC, rng)
        .set_desc(CUDNN_ATTR_OPERATION_RNG_SEED, *seed.desc)
        .set_desc(CUDNN_ATTR_OPERATION_RNG_OFFSET_DESC, *offset.desc);
    op.finalize("rng operation");
    ops_.push_back(&op);
    return y;
  }

  // The shape's masks: causal, then its sliding window (bound by value at execution, kWindowBound).
  TensorRef masks(TensorRef x, const AttentionShape& a) {
    if (a.causal) x = causal_mask(x, scalar(kNegInf));
    if (a.windowed()) x = window_mask(x, scalar(kWindowBound), scalar(kWindowNegInf));
    return x;
  }

  std::vector<std::unique_ptr<Descriptor>> release_descriptors() { return std::move(owned_); }
  const std::vector<const Descriptor*>& ops() const { return ops_; }

 private:
  static std::vector<int64_t> packed(const std::vector<int64_t>& dims) {
    std::vector<int64_t> s(dims.size(), 1);
    for (int i = static_cast<int>(dims.size()) - 2; i >= 0; --i) s[i] = s[i + 1] * dims[i + 1];
    return s;
  }
  Descriptor& own(cudnnBackendDescriptorType_t type) {
    owned_.push_back(std::make_unique<Descriptor>(type));
    return *owned_.back();
  }
  std::vector<std::unique_ptr<Descriptor>> owned_;
  std::vector<const Descriptor*> ops_;
  int64_t next_virtual_ = kFirstVirtual;
};

// An operation graph with everything it was built from, shared by its execution plans.
struct Graph {
  std::vector<std::unique_ptr<Descriptor>> parts;
  std::unique_ptr<Descriptor> graph, heuristics;
  std::vector<std::unique_ptr<Descriptor>> configs;
};

// One execution plan of a graph: one of cuDNN's engine configurations for it.
struct EnginePlan {
  std::shared_ptr<Graph> graph;
  std::shared_ptr<Descriptor> plan;
  int config = 0;          // index in cuDNN's heuristic order
  bool first_of_graph = false;  // the first configuration of its graph that built (cuDNN's pick)
  int64_t workspace = 0;   // cuDNN's own workspace
};

// At most this many engine configurations per graph: cuDNN lists its best guesses first, and
// every plan costs start-up time to build.
constexpr int kMaxConfigsPerGraph = 4;

// Every engine configuration of the graph that builds, in cuDNN's heuristic order; throws (with
// each failure) if none does.
std::vector<EnginePlan> build_plans(cudnnHandle_t handle, GraphBuilder& g, const std::string& what) {
  auto graph = std::make_shared<Graph>();
  std::vector<cudnnBackendDescriptor_t> ops;
  for (const Descriptor* d : g.ops()) ops.push_back(d->get());
  graph->graph = std::make_unique<Descriptor>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  graph->graph->set1(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, handle)
      .set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops.size()), ops.data());
  graph->graph->finalize(fmt::format("{} operation graph", what));
  graph->parts = g.release_descriptors();

  graph->heuristics = std::make_unique<Descriptor>(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  graph->heuristics->set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, *graph->graph)
      .set1(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, CUDNN_HEUR_MODE_A);
  graph->heuristics->finalize(fmt::format("{} heuristics", what));
  int64_t count = 0;
  check(cudnnBackendGetAttribute(graph->heuristics->get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                 CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
        "engine heuristics count");
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i) {
    graph->configs.push_back(std::make_unique<Descriptor>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
    raw.push_back(graph->configs.back()->get());
  }
  check(cudnnBackendGetAttribute(graph->heuristics->get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                 CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &count, raw.data()),
        "engine heuristics results");
  std::vector<EnginePlan> plans;
  std::string failures;
  for (int64_t i = 0; i < count && static_cast<int>(plans.size()) < kMaxConfigsPerGraph; ++i) {
    try {
      auto plan = std::make_shared<Descriptor>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      plan->set1(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, handle)
          .set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, *graph->configs[i]);
      plan->finalize(fmt::format("{} execution plan (engine config {})", what, i));
      int64_t ws = 0, got = 0;
      check(cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1,
                                     &got, &ws),
            "plan workspace size");
      plans.push_back({graph, std::move(plan), static_cast<int>(i), plans.empty(), ws});
    } catch (const CudnnFailure& e) {
      failures += std::string("; ") + e.what();
    }
  }
  if (plans.empty()) throw CudnnFailure(fmt::format("{}: none of {} engine configs builds{}", what, count, failures));
  return plans;
}

void execute(cudnnHandle_t handle, const Descriptor& plan, const std::vector<int64_t>& uids,
             const std::vector<void*>& ptrs, void* workspace) {
  Descriptor pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<int64_t>(uids.size()), uids.data())
      .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, static_cast<int64_t>(ptrs.size()), ptrs.data())
      .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
  pack.finalize("variant pack");
  check(cudnnBackendExecute(handle, plan.get(), pack.get()), "cudnnBackendExecute");
}

// ---- the attention graphs ----------------------------------------------------------------------

// How the graphs see GQA's K and V (MHA has only `shared`). Which is faster depends on the shape
// and cuDNN's engines, so both are candidates and the first call times them (choose_candidate).
// (A third layout, K/V copied per query head, never won: bench/RESULTS.md, the cuDNN attention candidates, 2026-11-22.)
enum class KvLayout {
  shared,     // one K/V head per (sample, group): MHA, or GQA as MQA with the KV group folded into the
              // batch; cuDNN reads each K/V head once and sums dK/dV over the group in the graph
  broadcast,  // GQA as MHA per (sample, group): K/V read with a zero head stride, dK/dV written per
              // query head into our workspace and summed by kv_heads::sum_grads
};

const char* layout_name(KvLayout l) {
  switch (l) {
    case KvLayout::shared: return "shared K/V";
    case KvLayout::broadcast: return "K/V broadcast per query head";
  }
  return "?";
}

// Layout facts shared by both passes, as 4-d [batch, heads, seq, d] tensors over the packed rows.
// MHA (heads == groups): batch b, heads h, head j's q, k, v at j*3d, j*3d+d, j*3d+2d of a row.
// GQA: the packed rows have no single per-head stride (a group's q heads are d apart, groups
// (hpg+2)d apart), but every stride is uniform once the KV group joins the batch: batch b*groups
// (sample i, group g at i*row_stride + g*(hpg+2)d = (i*groups + g)*(hpg+2)d), hpg query heads d
// apart. The output [N, heads*d] and the lse [b, heads, s] fold the same way (head g*hpg + j).
// With the shared layout cuDNN then sees MQA per (sample, group): one K/V head broadcast over the
// query heads, dK and dV sums over them (reductions in the backward graph). The broadcast layout
// gives every query head its own K/V head (a zero stride over the packed K/V), and dK/dV per query
// head in the output's layout.
struct Dims {
  int64_t b, hq, hk, s, d;   // b: batch as cuDNN sees it; hq/hk: query / KV heads
  int64_t bstride;           // qkv elements between batch entries
  int64_t hstride;           // qkv elements between query heads
  int64_t seq_stride;        // qkv elements between positions
  int64_t k_offset;          // elements from a batch entry's first q to its k (v: + d)
  int64_t out_b, out_seq;    // out strides of batch entries and positions (heads: d)
  int64_t kv_b, kv_h, kv_seq;   // strides of the K/V that cuDNN reads
  bool per_head_kv;          // broadcast GQA: dK/dV per query head, in the out layout
  Dims(const AttentionShape& a, KvLayout layout) : s(a.seq), d(a.head_dim) {
    const int64_t rs = a.qkv_row_stride(), hpg = a.heads / a.groups;
    seq_stride = a.batch * rs;
    out_seq = static_cast<int64_t>(a.batch) * a.heads * d;
    if (a.heads == a.groups) {
      b = a.batch, hq = hk = a.heads;
      bstride = rs, hstride = 3 * d, k_offset = d;
      out_b = a.heads * d;
    } else {
      b = static_cast<int64_t>(a.batch) * a.groups, hq = hpg, hk = 1;
      bstride = (hpg + 2) * d, hstride = d, k_offset = hpg * d;
      out_b = hpg * d;
    }
    kv_b = bstride, kv_h = hstride, kv_seq = seq_stride;
    per_head_kv = layout == KvLayout::broadcast && a.heads != a.groups;
    if (per_head_kv) hk = hq, kv_h = 0;
  }
  bool gqa() const { return hq != hk; }
  std::vector<int64_t> bhsd() const { return {b, hq, s, d}; }
  std::vector<int64_t> bhss() const { return {b, hq, s, s}; }
  std::vector<int64_t> bhs1() const { return {b, hq, s, 1}; }
  std::vector<int64_t> kv_bhsd() const { return {b, hk, s, d}; }
  std::vector<int64_t> kv_bhds() const { return {b, hk, d, s}; }
  std::vector<int64_t> q_strides() const { return {bstride, hstride, seq_stride, 1}; }      // [b, hq, s, d]
  std::vector<int64_t> kv_strides() const { return {kv_b, kv_h, kv_seq, 1}; }              // [b, hk, s, d]
  std::vector<int64_t> kv_t_strides() const { return {kv_b, kv_h, 1, kv_seq}; }            // [b, hk, d, s]
  std::vector<int64_t> dkv_strides() const { return per_head_kv ? out_strides() : kv_strides(); }
  std::vector<int64_t> out_strides() const { return {out_b, d, out_seq, 1}; }                // [b, hq, s, d]
  std::vector<int64_t> stats_strides() const { return {hq * s, s, 1, 1}; }                  // [b, hq, s, 1]
  std::vector<int64_t> scores_strides() const { return {hq * s * s, s * s, s, 1}; }         // [b, hq, s, s]
  std::vector<int64_t> scores_t_strides() const { return {hq * s * s, s * s, 1, s}; }
  std::vector<int64_t> packed_bhsd() const { return {hq * s * d, s * d, d, 1}; }
};

cudnnDataType_t io_type(DType t) { return t == DType::bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF; }

std::vector<EnginePlan> build_forward(cudnnHandle_t handle, const AttentionShape& a, DType dtype, KvLayout layout) {
  const Dims n(a, layout);
  const cudnnDataType_t io = io_type(dtype);
  GraphBuilder g;
  const TensorRef q = g.bound(n.bhsd(), n.q_strides(), io, kQ);
  const TensorRef kt = g.bound(n.kv_bhds(), n.kv_t_strides(), io, kK);
  const TensorRef v = g.bound(n.kv_bhsd(), n.kv_strides(), io, kV);
  const TensorRef scale = g.scalar(kScale);
  const TensorRef scores = g.virt(n.bhss(), n.scores_strides());
  g.matmul(q, kt, scores);
  TensorRef x = g.pointwise(CUDNN_POINTWISE_MUL, scores, &scale);
  x = g.masks(x, a);
  // Softmax with statistics: stats = max + log(sum(exp(x - max))), P = exp(x - max) / sum.
  const TensorRef row_max = g.virt(n.bhs1(), n.stats_strides());
  g.reduce_into(CUDNN_REDUCE_TENSOR_MAX, x, row_max);
  const TensorRef shifted = g.pointwise(CUDNN_POINTWISE_SUB, x, &row_max);
  const TensorRef e = g.pointwise(CUDNN_POINTWISE_EXP, shifted);
  const TensorRef row_sum = g.virt(n.bhs1(), n.stats_strides());
  g.reduce_into(CUDNN_REDUCE_TENSOR_ADD, e, row_sum);
  const TensorRef log_sum = g.pointwise(CUDNN_POINTWISE_LOG, row_sum);
  const TensorRef stats = g.bound(n.bhs1(), n.stats_strides(), CUDNN_DATA_FLOAT, kStats);
  g.pointwise_into(CUDNN_POINTWISE_ADD, row_max, &log_sum, nullptr, stats);
  TensorRef p;
  if (a.dropout_p > 0) {  // P * keep * 1/(1-p), as cudnn-frontend's SDPA forward with dropout
    const TensorRef probs = g.pointwise(CUDNN_POINTWISE_DIV, e, &row_sum);
    const TensorRef keep = g.dropout_mask(n.bhss(), n.scores_strides(), 1.0 - a.dropout_p);
    const TensorRef kept = g.pointwise(CUDNN_POINTWISE_MUL, probs, &keep);
    const TensorRef dropout_scale = g.scalar(kDropoutScale);
    p = g.pointwise(CUDNN_POINTWISE_MUL, kept, &dropout_scale, nullptr, io);
  } else {
    p = g.pointwise(CUDNN_POINTWISE_DIV, e, &row_sum, nullptr, io);
  }
  const TensorRef o = g.bound(n.bhsd(), n.out_strides(), io, kO);
  g.matmul(p, v, o);
  return build_plans(handle, g, fmt::format("attention forward ({})", layout_name(layout)));
}

// deterministic_dq: dQ straight from dS K (what cudnn-frontend builds for deterministic backward);
// otherwise through an fp32 accumulator in our workspace.
std::vector<EnginePlan> build_backward(cudnnHandle_t handle, const AttentionShape& a, DType dtype, KvLayout layout,
                                       bool deterministic_dq) {
  const Dims n(a, layout);
  const cudnnDataType_t io = io_type(dtype);
  GraphBuilder g;
  const TensorRef q = g.bound(n.bhsd(), n.q_strides(), io, kQ);
  const TensorRef kt = g.bound(n.kv_bhds(), n.kv_t_strides(), io, kK);
  const TensorRef vt = g.bound(n.kv_bhds(), n.kv_t_strides(), io, kV);
  const TensorRef o = g.bound(n.bhsd(), n.out_strides(), io, kO);
  const TensorRef dout = g.bound(n.bhsd(), n.out_strides(), io, kdO);
  const TensorRef stats = g.bound(n.bhs1(), n.stats_strides(), CUDNN_DATA_FLOAT, kStats);
  const TensorRef dq = g.bound(n.bhsd(), n.q_strides(), io, kdQ);
  const TensorRef dk = g.bound(n.kv_bhsd(), n.dkv_strides(), io, kdK);
  const TensorRef dv = g.bound(n.kv_bhsd(), n.dkv_strides(), io, kdV);
  const TensorRef scale = g.scalar(kScale);
  const TensorRef delta_scale = g.scalar(kDeltaScale);
  // Dropout (cudnn-frontend's SDPA backward): the keep mask redrawn from the forward's seed, Pd =
  // P * keep / (1-p) into dV, dP * keep, and delta scaled by (1-p) (kDeltaScale, 1 without
  // dropout) so that dS = P * (dP * keep - delta * (1-p)) / (1-p) = P * (dPd - delta).
  const bool dropout = a.dropout_p > 0;
  TensorRef keep, dropout_scale;
  if (dropout) {
    keep = g.dropout_mask(n.bhss(), n.scores_strides(), 1.0 - a.dropout_p);
    dropout_scale = g.scalar(kDropoutScale);
  }

  // delta = rowsum(dO * O) (times 1-p with dropout), materialized in our workspace.
  const TensorRef prod = g.virt(n.bhsd(), {n.hq * n.s * n.d, n.s * n.d, n.hq * n.d, 1});
  g.pointwise_into(CUDNN_POINTWISE_MUL, dout, &o, nullptr, prod);
  const TensorRef delta_raw = g.virt(n.bhs1(), n.stats_strides());
  g.reduce_into(CUDNN_REDUCE_TENSOR_ADD, prod, delta_raw);
  const TensorRef delta = g.bound(n.bhs1(), n.stats_strides(), CUDNN_DATA_FLOAT, kSoftmaxSum);
  g.pointwise_into(CUDNN_POINTWISE_MUL, delta_raw, &delta_scale, nullptr, delta);

  // P = exp(scale * Q K^T - stats), masked.
  const TensorRef scores = g.virt(n.bhss(), n.scores_strides());
  g.matmul(q, kt, scores);
  TensorRef x = g.pointwise(CUDNN_POINTWISE_MUL, scores, &scale);
  x = g.pointwise(CUDNN_POINTWISE_SUB, x, &stats);
  x = g.masks(x, a);
  const TensorRef p = g.pointwise(CUDNN_POINTWISE_EXP, x);

  // dV = Pd^T dO (shared GQA: per query head, then summed over the group's heads).
  TensorRef pd = p;
  if (dropout) {
    pd = g.pointwise(CUDNN_POINTWISE_MUL, p, &keep);
    pd = g.pointwise(CUDNN_POINTWISE_MUL, pd, &dropout_scale);
  }
  const TensorRef pt = g.reshape(pd, n.bhss(), n.scores_t_strides(), io);
  if (n.gqa()) {
    const TensorRef dv_heads = g.virt(n.bhsd(), n.packed_bhsd(), io);
    g.matmul(pt, dout, dv_heads);
    g.reduce_into(CUDNN_REDUCE_TENSOR_ADD, dv_heads, dv);
  } else {
    g.matmul(pt, dout, dv);
  }
  // dS = P * (dO V^T - delta) * scale.
  TensorRef dp = g.virt(n.bhss(), n.scores_strides());
  g.matmul(dout, vt, dp);
  if (dropout) dp = g.pointwise(CUDNN_POINTWISE_MUL, dp, &keep);
  const TensorRef centered = g.pointwise(CUDNN_POINTWISE_SUB, dp, &delta);
  TensorRef ds_unscaled = g.pointwise(CUDNN_POINTWISE_MUL, centered, &p);
  if (dropout) ds_unscaled = g.pointwise(CUDNN_POINTWISE_MUL, ds_unscaled, &dropout_scale);
  const TensorRef ds = g.pointwise(CUDNN_POINTWISE_MUL, ds_unscaled, &scale);
  // dK = dS^T Q (shared GQA: per query head, then summed).
  const TensorRef dst = g.reshape(ds, n.bhss(), n.scores_t_strides(), io);
  if (n.gqa()) {
    const TensorRef dk_heads = g.virt(n.bhsd(), n.packed_bhsd(), io);
    g.matmul(dst, q, dk_heads);
    g.reduce_into(CUDNN_REDUCE_TENSOR_ADD, dk_heads, dk);
  } else {
    g.matmul(dst, q, dk);
  }
  // dQ = dS K.
  const TensorRef k = g.reshape(kt, n.kv_bhsd(), n.kv_strides(), CUDNN_DATA_FLOAT);
  if (deterministic_dq) {
    g.matmul(ds, k, dq);
  } else {
    const TensorRef accum = g.bound(n.bhsd(), n.packed_bhsd(), CUDNN_DATA_FLOAT, kdQAccum);
    g.matmul(ds, k, accum);
    g.pointwise_into(CUDNN_POINTWISE_IDENTITY, accum, nullptr, nullptr, dq);
  }
  return build_plans(handle, g,
                     fmt::format("attention backward ({}, dQ {})", layout_name(layout),
                                 deterministic_dq ? "direct" : "accumulated"));
}

// ---- candidates and the plan cache -------------------------------------------------------------

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

// Dropout's Philox state at the start of our workspace: the seed (int64) at byte 0, the offset at
// byte 16 (each 16-byte aligned, as the graphs' tensors declare).
constexpr size_t kRngStateBytes = 256;

// One way to run a pass: a layout, the backward's dQ algorithm, and one engine plan.
// Workspace: [ours][cuDNN's]. Ours: forward [dropout's seed and offset, with dropout]; backward
// [seed and offset, with dropout][delta][dQ accumulator, if used][dK, dV per query head, if broadcast].
struct Candidate {
  KvLayout layout = KvLayout::shared;
  bool direct_dq = true;  // backward: dQ = dS K straight (else through the fp32 accumulator, by atomics)
  EnginePlan engine;
  size_t ours = 0;        // bytes of our part of the workspace
  size_t bytes() const { return ours + static_cast<size_t>(engine.workspace); }
  std::string name(bool backward) const {
    return fmt::format("{}{}, engine config {}", layout_name(layout),
                       backward ? (direct_dq ? ", dQ direct" : ", dQ by fp32 atomics") : "", engine.config);
  }
};

struct Pass {
  std::vector<Candidate> candidates;
  int chosen = -1;          // index into candidates; -1: timed at the next call
  double chosen_ms = 0;     // its time when it was chosen by timing (0: not timed)
  size_t bytes() const {
    size_t b = 0;
    for (const Candidate& c : candidates) b = std::max(b, c.bytes());
    return b;
  }
};

struct Plans {
  Pass forward, backward;
  bool fixed_choice = false;  // --deterministic-mode: no timing
  size_t rng_bytes = 0, delta_bytes = 0, accum_bytes = 0, heads_bytes = 0;  // workspace pieces (see Candidate)
  std::string error;  // non-empty: this shape is not supported, and why
  std::string refused;  // layouts cuDNN had no engine for (reported, not an error)
  size_t bytes() const { return std::max(forward.bytes(), backward.bytes()); }
};

// device, b, s, heads, groups, d, causal, window, dtype, deterministic, dropout probability
using Key = std::tuple<int, int, int, int, int, int, bool, int, int, bool, float>;

std::mutex g_mutex;
std::map<int, cudnnHandle_t> g_handles;
std::map<Key, std::unique_ptr<Plans>> g_plans;

cudnnHandle_t handle_for(int device) {
  auto it = g_handles.find(device);
  if (it != g_handles.end()) return it->second;
  cudnnHandle_t h = nullptr;
  check(cudnnCreate(&h), "cudnnCreate");
  g_handles[device] = h;
  return h;
}

std::string unsupported_reason(const AttentionShape& a, DType dtype) {
  if (dtype != DType::bf16 && dtype != DType::f16) return "it needs bf16 or fp16 activations";
  if (a.documents) return "packed documents (--reset-attention-mask) are not built into megatrain's cuDNN graphs yet";
  // (cudnn-frontend's support surface takes a sliding window with dropout from 9.10.2 on.)
  if (a.dropout_p > 0 && a.windowed() && cudnnGetVersion() < 91002)
    return fmt::format("cuDNN {} takes no sliding window with dropout (9.10.2 and newer do)", cudnnGetVersion());
  // (Up to 256 on Hopper: cuDNN itself then says which shapes its engines take, plans_for's error.)
  if (a.head_dim % 8 != 0 || a.head_dim > 256) return fmt::format("head dim {} (cuDNN needs a multiple of 8, <= 256)", a.head_dim);
  return "";
}


// Candidates worth timing: those whose workspace is within max(2x, +256 MiB) of the smallest. The
// deterministic-dQ engines keep an s x s buffer per (sample, head) in their workspace (2 GiB at
// llama-1b's shape); this keeps them out where the accumulated dQ needs far less, as Megatron's
// fused attention defaults to the non-deterministic algorithm.
void keep_affordable(Pass& pass) {
  size_t least = SIZE_MAX;
  for (const Candidate& c : pass.candidates) least = std::min(least, c.bytes());
  const size_t budget = std::max(2 * least, least + (size_t{256} << 20));
  std::vector<Candidate> kept;
  for (Candidate& c : pass.candidates)
    if (c.bytes() <= budget) kept.push_back(std::move(c));
  pass.candidates = std::move(kept);
}

// Without timing: cuDNN's first engine configuration of the shared layout's graphs, the direct dQ
// where its workspace is no larger than the accumulated one's (what this path ran before it timed
// candidates; another configuration with a smaller workspace can be twice as slow).
int default_candidate(const Pass& pass) {
  int best = -1;
  for (int i = 0; i < static_cast<int>(pass.candidates.size()); ++i) {
    const Candidate& c = pass.candidates[i];
    if (c.layout != KvLayout::shared || !c.engine.first_of_graph) continue;
    if (best < 0 || c.bytes() < pass.candidates[best].bytes()) best = i;
  }
  MT_CHECK(best >= 0, "cuDNN attention: no first-choice engine plan among {} candidates", pass.candidates.size());
  return best;
}

void build_candidates(cudnnHandle_t handle, const AttentionShape& a, DType dtype, Plans& plans) {
  const size_t rows = static_cast<size_t>(a.batch) * a.heads * a.seq;
  plans.rng_bytes = a.dropout_p > 0 ? kRngStateBytes : 0;
  plans.delta_bytes = align256(rows * sizeof(float));
  plans.accum_bytes = align256(rows * a.head_dim * sizeof(float));
  plans.heads_bytes = align256(kv_heads::buffer_bytes(a, dtype));
  plans.fixed_choice = a.deterministic;
  // The per-query-head layouts only as timed candidates: untimed, the shared one runs.
  std::vector<KvLayout> layouts = {KvLayout::shared};
  if (a.heads != a.groups && !plans.fixed_choice) layouts.push_back(KvLayout::broadcast);
  std::string first_error;
  for (KvLayout layout : layouts) {
    const size_t grads = layout == KvLayout::broadcast ? 2 * plans.heads_bytes : 0;
    try {
      std::vector<Candidate> fwd, bwd;
      for (EnginePlan& e : build_forward(handle, a, dtype, layout))
        fwd.push_back({layout, true, std::move(e), plans.rng_bytes});
      for (bool direct : {true, false}) {
        if (!direct && a.deterministic) continue;
        try {
          const size_t ours = plans.rng_bytes + plans.delta_bytes + (direct ? 0 : plans.accum_bytes) + grads;
          for (EnginePlan& e : build_backward(handle, a, dtype, layout, direct)) bwd.push_back({layout, direct, std::move(e), ours});
        } catch (const CudnnFailure& e) {
          if (direct && a.deterministic) throw;
          if (first_error.empty()) first_error = e.what();
        }
      }
      if (bwd.empty()) throw CudnnFailure(first_error);
      // A layout counts only with both passes: a pass's choice must not depend on the other's.
      for (Candidate& c : fwd) plans.forward.candidates.push_back(std::move(c));
      for (Candidate& c : bwd) plans.backward.candidates.push_back(std::move(c));
    } catch (const CudnnFailure& e) {
      if (layout == KvLayout::shared) throw;  // the layout every shape has: no engine at all
      plans.refused += fmt::format("; {}: {}", layout_name(layout), e.what());
    }
  }
  if (!a.deterministic) {
    keep_affordable(plans.forward);
    keep_affordable(plans.backward);
  }
  if (plans.fixed_choice) {
    plans.forward.chosen = default_candidate(plans.forward);
    plans.backward.chosen = default_candidate(plans.backward);
  }
}

// Returns the cached plans for the shape (building them the first time); never null.
Plans& plans_for(const AttentionShape& a, DType dtype) {
  int device = 0;
  MT_CUDA_CHECK(cudaGetDevice(&device));
  const Key key{device,   a.batch,       a.seq,      a.heads, a.groups, a.head_dim, a.causal, a.window_left,
                static_cast<int>(dtype), a.deterministic, a.dropout_p};
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_plans.find(key);
  if (it != g_plans.end()) return *it->second;
  auto plans = std::make_unique<Plans>();
  plans->error = unsupported_reason(a, dtype);
  if (plans->error.empty()) {
    try {
      build_candidates(handle_for(device), a, dtype, *plans);
    } catch (const CudnnFailure& e) {
      plans->forward = Pass{};
      plans->backward = Pass{};
      plans->error = fmt::format("cuDNN {} has no engine for it{}: {}", cudnnGetVersion(),
                                 a.deterministic ? " with a deterministic backward (--deterministic-mode)" : "",
                                 e.what());
    }
  }
  return *(g_plans[key] = std::move(plans));
}

Plans& supported_plans(const AttentionShape& a, DType dtype) {
  std::string reason = unsupported_reason(a, dtype);
  Plans* p = reason.empty() ? &plans_for(a, dtype) : nullptr;
  if (p) reason = p->error;
  if (!reason.empty())
    throw Unsupported(fmt::format("--attention-backend fused does not support this attention (b={} s={} heads={} "
                                  "groups={} d={}): {}",
                                  a.batch, a.seq, a.heads, a.groups, a.head_dim, reason));
  return *p;
}

cudnnHandle_t current_handle() {
  int device = 0;
  MT_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(g_mutex);
  return handle_for(device);
}

std::string shape_label(const AttentionShape& a) {
  return fmt::format("b={} s={} heads={}/{} d={}", a.batch, a.seq, a.heads, a.groups, a.head_dim);
}

// The pass's chosen candidate; on the first call of a shape (unless the choice is fixed) every
// candidate runs on the caller's buffers, 1 + 3 times, and the fastest median is kept. Each run
// overwrites the pass's outputs completely, so the caller's run of the chosen one afterwards
// leaves exactly its result. Candidates that fail to execute are skipped.
const Candidate& choose_candidate(Pass& pass, const AttentionShape& a, const char* what,
                                  const std::function<void(const Candidate&)>& run, cudaStream_t stream) {
  if (pass.chosen >= 0) return pass.candidates[pass.chosen];
  if (pass.candidates.size() == 1) {
    pass.chosen = 0;
    return pass.candidates[0];
  }
  constexpr int kTimed = 3;
  std::vector<double> ms(pass.candidates.size(), std::numeric_limits<double>::infinity());
  cudaEvent_t ev[kTimed + 1];
  for (auto& e : ev) MT_CUDA_CHECK(cudaEventCreate(&e));
  std::string failures;
  for (size_t i = 0; i < pass.candidates.size(); ++i) {
    try {
      run(pass.candidates[i]);
      MT_CUDA_CHECK(cudaEventRecord(ev[0], stream));
      for (int r = 0; r < kTimed; ++r) {
        run(pass.candidates[i]);
        MT_CUDA_CHECK(cudaEventRecord(ev[r + 1], stream));
      }
      MT_CUDA_CHECK(cudaEventSynchronize(ev[kTimed]));
      std::vector<float> t(kTimed);
      for (int r = 0; r < kTimed; ++r) MT_CUDA_CHECK(cudaEventElapsedTime(&t[r], ev[r], ev[r + 1]));
      std::sort(t.begin(), t.end());
      ms[i] = t[kTimed / 2];
    } catch (const CudnnFailure& e) {
      failures += fmt::format("; {}: {}", pass.candidates[i].name(std::string(what) == "backward"), e.what());
    }
  }
  for (auto& e : ev) MT_CUDA_CHECK(cudaEventDestroy(e));
  const size_t best = static_cast<size_t>(std::min_element(ms.begin(), ms.end()) - ms.begin());
  if (!std::isfinite(ms[best]))
    throw std::runtime_error(fmt::format("cuDNN attention {} ({}): no candidate executes{}", what, shape_label(a), failures));
  pass.chosen = static_cast<int>(best);
  pass.chosen_ms = ms[best];
  std::string table;
  for (size_t i = 0; i < ms.size(); ++i) table += fmt::format("{}{:.3f}", i ? " / " : "", ms[i]);
  log::info("cuDNN attention {} ({}): {} of {} candidates, {:.3f} ms (all, ms: {})", what, shape_label(a),
            pass.candidates[best].name(std::string(what) == "backward"), ms.size(), ms[best], table);
  return pass.candidates[best];
}

std::vector<std::string> names_of(const Pass& pass, bool backward) {
  std::vector<std::string> names;
  for (const Candidate& c : pass.candidates) names.push_back(c.name(backward));
  return names;
}

}  // namespace

int runtime_version() { return static_cast<int>(cudnnGetVersion()); }

bool supported(const AttentionShape& a, DType dtype, std::string* why) {
  std::string reason = unsupported_reason(a, dtype);
  if (reason.empty()) reason = plans_for(a, dtype).error;
  if (why) *why = reason;
  return reason.empty();
}

size_t workspace_bytes(const AttentionShape& a, DType dtype) { return supported_plans(a, dtype).bytes(); }

std::string describe(const AttentionShape& a, DType dtype) {
  const Plans& p = supported_plans(a, dtype);
  std::string how;
  if (p.fixed_choice) {
    how = fmt::format("forward {}, backward {}", p.forward.candidates[p.forward.chosen].name(false),
                      p.backward.candidates[p.backward.chosen].name(true));
    how += " (--deterministic-mode: the deterministic dQ, not timed)";
  } else {
    how = fmt::format("the fastest of {} forward / {} backward candidates, timed at the first step",
                      p.forward.candidates.size(), p.backward.candidates.size());
  }
  const std::string dropout =
      a.dropout_p > 0 ? fmt::format(", dropout {:g} (cuDNN's Philox mask)", a.dropout_p) : std::string();
  return fmt::format("cuDNN {} fused attention{}{}, {}, workspace {:.1f} MiB", cudnnGetVersion(), window_text(a), dropout,
                     how, p.bytes() / 1048576.0);
}

std::vector<std::string> forward_candidates(const AttentionShape& a, DType dtype) {
  return names_of(supported_plans(a, dtype).forward, false);
}
std::vector<std::string> backward_candidates(const AttentionShape& a, DType dtype) {
  return names_of(supported_plans(a, dtype).backward, true);
}

void pin_candidates(const AttentionShape& a, DType dtype, int forward_index, int backward_index) {
  Plans& p = supported_plans(a, dtype);
  MT_CHECK(forward_index >= -1 && forward_index < static_cast<int>(p.forward.candidates.size()) &&
               backward_index >= -1 && backward_index < static_cast<int>(p.backward.candidates.size()),
           "pin_candidates: no candidate {} / {} (there are {} / {})", forward_index, backward_index,
           p.forward.candidates.size(), p.backward.candidates.size());
  p.forward.chosen = forward_index;
  p.backward.chosen = backward_index;
}

std::string chosen(const AttentionShape& a, DType dtype) {
  const Plans& p = supported_plans(a, dtype);
  auto one = [](const Pass& pass, bool backward) {
    if (pass.chosen < 0) return std::string("not chosen yet");
    std::string s = pass.candidates[pass.chosen].name(backward);
    if (pass.chosen_ms > 0) s += fmt::format(" ({:.3f} ms, the fastest of {})", pass.chosen_ms, pass.candidates.size());
    return s;
  };
  std::string s = fmt::format("forward: {}; backward: {}", one(p.forward, false), one(p.backward, true));
  if (!p.refused.empty()) s += "; no engine for" + p.refused;
  return s;
}

// Dropout's tensors: the seed and offset in the workspace's first bytes (written on the stream:
// the seed is the shape's Philox key, the offset 0) and the by-value scale 1/(1-p).
static void bind_dropout(const AttentionShape& a, void* rng_state, float& dropout_scale, std::vector<int64_t>& uids,
                         std::vector<void*>& ptrs, cudaStream_t stream) {
  if (a.dropout_p <= 0) return;
  char* state = static_cast<char*>(rng_state);
  write_philox_state(state, state + 16, a.dropout_key, stream);
  uids.insert(uids.end(), {kSeed, kOffset, kDropoutScale});
  ptrs.insert(ptrs.end(), {state, state + 16, &dropout_scale});
}

// The by-value scalars of GraphBuilder::masks: -inf for each mask, and the window's key count.
static void bind_mask_scalars(const AttentionShape& a, std::vector<int64_t>& uids, std::vector<void*>& ptrs,
                              float& neg_inf, float& window_bound) {
  if (a.causal) {
    uids.push_back(kNegInf);
    ptrs.push_back(&neg_inf);
  }
  if (a.windowed()) {
    uids.push_back(kWindowBound);
    ptrs.push_back(&window_bound);
    uids.push_back(kWindowNegInf);
    ptrs.push_back(&neg_inf);
  }
}

void forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a, void* workspace, size_t workspace_bytes,
             cudaStream_t stream) {
  Plans& p = supported_plans(a, qkv.dtype);
  MT_CHECK(workspace_bytes >= p.forward.bytes(), "fused attention forward workspace has {} bytes, needs {}",
           workspace_bytes, p.forward.bytes());
  const cudnnHandle_t handle = current_handle();
  check(cudnnSetStream(handle, stream), "cudnnSetStream");
  float scale = a.softmax_scale, neg_inf = -std::numeric_limits<float>::infinity();
  float window_bound = static_cast<float>(a.window_left + 1), dropout_scale = 1.0f / (1.0f - a.dropout_p);
  char* base = static_cast<char*>(qkv.data);
  const size_t elem = dtype_size(qkv.dtype);
  auto run = [&](const Candidate& c) {
    const size_t k_bytes = static_cast<size_t>(Dims(a, c.layout).k_offset) * elem, d_bytes = a.head_dim * elem;
    void *k = base + k_bytes, *v = base + k_bytes + d_bytes;
    std::vector<int64_t> uids = {kQ, kK, kV, kO, kStats, kScale};
    std::vector<void*> ptrs = {base, k, v, out.data, lse.data, &scale};
    bind_mask_scalars(a, uids, ptrs, neg_inf, window_bound);
    bind_dropout(a, workspace, dropout_scale, uids, ptrs, stream);
    execute(handle, *c.engine.plan, uids, ptrs, static_cast<char*>(workspace) + c.ours);
  };
  run(choose_candidate(p.forward, a, "forward", run, stream));
}

void backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a, void* workspace,
              size_t workspace_bytes, cudaStream_t stream) {
  Plans& p = supported_plans(a, qkv.dtype);
  MT_CHECK(workspace != nullptr && workspace_bytes >= p.backward.bytes(),
           "fused attention backward workspace has {} bytes, needs {}", workspace_bytes, p.backward.bytes());
  const cudnnHandle_t handle = current_handle();
  check(cudnnSetStream(handle, stream), "cudnnSetStream");
  float scale = a.softmax_scale, neg_inf = -std::numeric_limits<float>::infinity();
  float delta_scale = 1.0f - a.dropout_p, dropout_scale = 1.0f / (1.0f - a.dropout_p);
  float window_bound = static_cast<float>(a.window_left + 1);
  char* x = static_cast<char*>(qkv.data);
  char* dx = static_cast<char*>(dqkv.data);
  const size_t elem = dtype_size(qkv.dtype);
  char* ws = static_cast<char*>(workspace);
  auto run = [&](const Candidate& c) {
    const Dims n(a, c.layout);
    const size_t k_bytes = static_cast<size_t>(n.k_offset) * elem, d_bytes = a.head_dim * elem;
    // Our workspace pieces in order: dropout's seed and offset, delta, dQ accumulator, per-head dK/dV.
    char* delta = ws + p.rng_bytes;
    char* next = delta + p.delta_bytes;
    char* accum = nullptr;
    if (!c.direct_dq) accum = next, next += p.accum_bytes;
    void *k = x + k_bytes, *v = x + k_bytes + d_bytes, *dk = dx + k_bytes, *dv = dx + k_bytes + d_bytes;
    if (n.per_head_kv) dk = next, dv = next + p.heads_bytes;
    std::vector<int64_t> uids = {kQ, kK, kV, kO, kdO, kStats, kdQ, kdK, kdV, kScale, kDeltaScale, kSoftmaxSum};
    std::vector<void*> ptrs = {x, k, v, out.data, dout.data, lse.data, dx, dk, dv, &scale, &delta_scale, delta};
    bind_mask_scalars(a, uids, ptrs, neg_inf, window_bound);
    bind_dropout(a, ws, dropout_scale, uids, ptrs, stream);
    if (accum) {
      uids.push_back(kdQAccum);
      ptrs.push_back(accum);
    }
    execute(handle, *c.engine.plan, uids, ptrs, ws + c.ours);
    if (n.per_head_kv) kv_heads::sum_grads(dqkv.data, dk, dv, a, qkv.dtype, stream);
  };
  run(choose_candidate(p.backward, a, "backward", run, stream));
}

}  // namespace mt::cuda::cudnn_attention
