// Attention blocks of context parallelism on the CUDA backend (cuda/attention_blocks.cu) against
// the reference backend, on fresh random bf16 inputs.
//
// A sequence of 2 CP c positions is split as engine/blocks/attention_cp.cpp splits it (rank r
// holds chunks r and 2 CP - 1 - r; the ring visits the other ranks' chunks in its order), and
// every visible block (the diagonal ones and those wholly before their queries) runs through
// attention_block_forward + attention_merge, then attention_block_backward with the merged out
// and lse, on the CUDA backend (its automatic choice, cuDNN where it runs, and the flash kernels)
// and on the reference backend (float32 copies of the same values). out, lse, dQ, dK and dV are
// compared with the reference's blocks and with the reference's attention over the whole
// sequence. The reference backward gets the CUDA forward's merged out and lse (as
// tests/gpu/attention_test.cpp does), so each pass is checked on its own. No dropout: the CUDA
// blocks draw their masks by block-local indices, not the reference's global ones.
// Tolerances as tests/gpu/attention_test.cpp's for bf16: relative L2 error <= 1e-2 (out, dQ, dK,
// dV), max abs error <= 1e-3 (lse).
//
// Also: attention_merge (with rows that saw no key on either side or both), attention_kv_pack and
// attention_kv_unpack_add (exact), an empty block (wholly after its queries), and what the CUDA
// blocks refuse (sliding windows, partly visible blocks, blocks of another length).
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda/attention.h"
#include "tests/gpu/attention_test_util.h"
#include "tests/gpu/gpu_test_util.h"

using namespace mt;
using namespace mt::gputest;

namespace {

constexpr double kRelTol = 1e-2;
constexpr double kLseTol = 1e-3;
constexpr double kInf = std::numeric_limits<double>::infinity();
const DType kBf16 = DType::bf16;

struct CpCase {
  int cp, b, c, heads, groups, d;
  int max_doc = 0;  // packed documents of random lengths in [1, max_doc] over the whole sequence (0: none)
  std::string name() const {
    return fmt::format("CP{} b{} c{} heads {}/{} d{}{}", cp, b, c, heads, groups, d,
                       max_doc > 0 ? fmt::format(" documents <= {}", max_doc) : std::string());
  }
};

// The CUDA backends under test: the shared one (--attention-backend auto: cuDNN where it runs)
// and one whose attention is pinned to the flash kernels.
Backend& flash_backend() {
  static std::unique_ptr<Backend> be = [] {
    auto b = make_cuda_backend(0);
    b->reserve_attention(AttentionShape::make(1, 64, 4, 4, 64), AttentionBackend::flash, kBf16);
    return b;
  }();
  return *be;
}

// Rows [r0, r0 + rows) of a host matrix of `cols` columns.
std::vector<double> rows_of(const std::vector<double>& m, int64_t cols, int64_t r0, int64_t rows) {
  return std::vector<double>(m.begin() + r0 * cols, m.begin() + (r0 + rows) * cols);
}

// The q, k and v parts of packed QKV rows (host), each in row order.
struct QkvParts {
  std::vector<double> q, k, v;
};
QkvParts split_qkv(const std::vector<double>& x, const AttentionShape& a) {
  QkvParts p;
  const int64_t hpg = a.heads / a.groups, d = a.head_dim, run = (hpg + 2) * d;
  for (size_t base = 0; base < x.size(); base += static_cast<size_t>(run))
    for (int64_t j = 0; j < run; ++j) {
      const double e = x[base + static_cast<size_t>(j)];
      if (j < hpg * d) p.q.push_back(e);
      else if (j < (hpg + 1) * d) p.k.push_back(e);
      else p.v.push_back(e);
    }
  return p;
}

double max_abs_diff(const std::vector<double>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) return kInf;
  double m = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = std::abs(got[i] - want[i]);
    if (!(e <= m)) m = std::isnan(e) ? kInf : e;  // NaN counts as infinitely wrong
  }
  return m;
}

struct Errors {
  double out = 0, lse = 0, dq = 0, dk = 0, dv = 0;
  std::string text() const {
    return fmt::format("out {:.2e} lse {:.2e} dq {:.2e} dk {:.2e} dv {:.2e}", out, lse, dq, dk, dv);
  }
};

void check_errors(const std::string& line, const Errors& e) {
  INFO(line);
  std::printf("%s\n", line.c_str());
  CHECK(e.out <= kRelTol);
  CHECK(e.lse <= kLseTol);
  CHECK(e.dq <= kRelTol);
  CHECK(e.dk <= kRelTol);
  CHECK(e.dv <= kRelTol);
}

// One case on CUDA backend `be` (and the reference), inputs from `rng`.
void run_case(const CpCase& k, Backend& be, const char* be_name, Rng& rng) {
  const int chunks = 2 * k.cp;
  const int64_t S = static_cast<int64_t>(chunks) * k.c, c = k.c;
  AttentionShape whole = AttentionShape::make(k.b, static_cast<int>(S), k.heads, k.groups, k.d);
  AttentionShape ac = AttentionShape::make(k.b, k.c, k.heads, k.groups, k.d);
  // Packed documents: the whole sequence's starts, on the device for the CUDA blocks (ac) and on
  // the host for the reference's (acr) and its whole-sequence attention.
  std::vector<int32_t> starts;
  test::attention::DeviceValues d_starts(k.max_doc > 0 ? static_cast<size_t>(k.b * S) : 1, DType::f32);
  if (k.max_doc > 0) {
    starts = test::attention::random_documents(k.b, static_cast<int>(S), k.max_doc, 5 + S + k.max_doc);
    MT_CUDA_CHECK(cudaMemcpy(d_starts.ptr, starts.data(), starts.size() * 4, cudaMemcpyHostToDevice));
    whole.documents = ac.documents = true;
    whole.doc_start = Tensor(starts.data(), DType::i32, Device::cpu, {k.b * S});
    ac.doc_start = Tensor(d_starts.ptr, DType::i32, Device::cuda, {k.b * S});
  }
  AttentionShape acr = ac;
  acr.doc_start = whole.doc_start;
  const int64_t rs = ac.qkv_row_stride(), oc = static_cast<int64_t>(k.heads) * k.d, kvc = 2LL * k.groups * k.d;
  const int64_t crows = c * k.b;  // rows of one chunk (positions [qi c, qi c + c), sequence-major)
  const std::string name = fmt::format("{} | {}", k.name(), be_name);
  INFO(name);
  be.reserve_attention_blocks(ac, k.c, kBf16);

  std::vector<double> qkv = rng.normal(k.b * S * rs), dout = rng.normal(k.b * S * oc);
  for (double& x : qkv) x = round_to(kBf16, x);
  for (double& x : dout) x = round_to(kBf16, x);

  // Per chunk: its packed rows, their keys and values, the merged out and lse, the gradients.
  std::vector<Twin> q, kv, out, lse, dq, dkv, dO;
  std::vector<double> dq_init(static_cast<size_t>(crows * rs));
  {
    const int64_t hpg = k.heads / k.groups;
    for (size_t e = 0; e < dq_init.size(); ++e)  // query parts 0, key/value parts a marker
      dq_init[e] = static_cast<int64_t>(e) % ((hpg + 2) * k.d) < hpg * k.d ? 0.0 : 7.0;
  }
  for (int ch = 0; ch < chunks; ++ch) {
    q.push_back(twin(kBf16, {crows, rs}, rows_of(qkv, rs, ch * crows, crows)));
    dO.push_back(twin(kBf16, {crows, oc}, rows_of(dout, oc, ch * crows, crows)));
    kv.push_back(twin_nan(kBf16, {crows, kvc}));
    out.push_back(twin_nan(kBf16, {crows, oc}));
    lse.push_back(twin_nan(DType::f32, {k.b, k.heads, k.c}));
    dq.push_back(twin(kBf16, {crows, rs}, dq_init));
    dkv.push_back(twin(kBf16, {crows, kvc}, std::vector<double>(static_cast<size_t>(crows * kvc), 0.0)));
  }
  Twin out_blk = twin_nan(kBf16, {crows, oc}), lse_blk = twin_nan(DType::f32, {k.b, k.heads, k.c});

  for (int ch = 0; ch < chunks; ++ch) {
    be.attention_kv_pack(kv[ch].c(), q[ch].c(), ac);
    ref().attention_kv_pack(kv[ch].r(), q[ch].r(), ac);
  }

  // The blocks in attention_cp.cpp's order: rank r, ring step (the keys of rank r - step), the
  // owner's two chunks, this rank's two query chunks.
  auto owned = [&](int owner, int local) { return local == 0 ? owner : chunks - 1 - owner; };
  auto for_each_block = [&](auto&& f) {
    for (int r = 0; r < k.cp; ++r) {
      bool first[2] = {true, true};
      for (int step = 0; step < k.cp; ++step) {
        const int owner = (r - step + k.cp) % k.cp;
        for (int kc = 0; kc < 2; ++kc)
          for (int qc = 0; qc < 2; ++qc) {
            const int qi = owned(r, qc), ki = owned(owner, kc);
            if (ki > qi) continue;  // no key of chunk ki precedes a query of chunk qi: invisible
            AttentionBlock blk;
            blk.q_begin = qi * c;
            blk.k_begin = ki * c;
            blk.kv_len = k.c;
            blk.seq_total = S;
            f(qi, ki, blk, first[qc]);
            first[qc] = false;
          }
      }
    }
  };

  // Forward: the first block of a query chunk writes, the later ones merge.
  for_each_block([&](int qi, int ki, const AttentionBlock& blk, bool first) {
    if (first) {
      be.attention_block_forward(out[qi].c(), lse[qi].c(), q[qi].c(), kv[ki].c(), ac, blk);
      ref().attention_block_forward(out[qi].r(), lse[qi].r(), q[qi].r(), kv[ki].r(), acr, blk);
    } else {
      be.attention_block_forward(out_blk.c(), lse_blk.c(), q[qi].c(), kv[ki].c(), ac, blk);
      be.attention_merge(out[qi].c(), lse[qi].c(), out_blk.c(), lse_blk.c());
      ref().attention_block_forward(out_blk.r(), lse_blk.r(), q[qi].r(), kv[ki].r(), acr, blk);
      ref().attention_merge(out[qi].r(), lse[qi].r(), out_blk.r(), lse_blk.r());
    }
  });

  // The CUDA forward's merged out and lse, per chunk and in the whole sequence's layout.
  std::vector<Twin> out_in, lse_in;
  std::vector<double> out_g, lse_g(static_cast<size_t>(k.b * k.heads * S));
  std::vector<double> out_r, lse_r(lse_g.size());  // the reference blocks' (for the forward check)
  for (int ch = 0; ch < chunks; ++ch) {
    const std::vector<double> o = download(be, out[ch].c()), l = download(be, lse[ch].c());
    const std::vector<double> orf = download(ref(), out[ch].r()), lrf = download(ref(), lse[ch].r());
    out_in.push_back(twin(kBf16, {crows, oc}, o));
    lse_in.push_back(twin(DType::f32, {k.b, k.heads, k.c}, l));
    out_g.insert(out_g.end(), o.begin(), o.end());
    out_r.insert(out_r.end(), orf.begin(), orf.end());
    for (int64_t bh = 0; bh < static_cast<int64_t>(k.b) * k.heads; ++bh)
      for (int64_t t = 0; t < c; ++t) {
        lse_g[static_cast<size_t>(bh * S + ch * c + t)] = l[static_cast<size_t>(bh * c + t)];
        lse_r[static_cast<size_t>(bh * S + ch * c + t)] = lrf[static_cast<size_t>(bh * c + t)];
      }
  }
  dev().synchronize();  // (the twins above were written on the shared backend's stream)

  for_each_block([&](int qi, int ki, const AttentionBlock& blk, bool) {
    be.attention_block_backward(dq[qi].c(), dkv[ki].c(), dO[qi].c(), out_in[qi].c(), lse_in[qi].c(), q[qi].c(),
                                kv[ki].c(), ac, blk);
    ref().attention_block_backward(dq[qi].r(), dkv[ki].r(), dO[qi].r(), out_in[qi].r(), lse_in[qi].r(), q[qi].r(),
                                   kv[ki].r(), acr, blk);
  });

  // The gradient of the whole sequence's packed rows: dQ from dq, dK and dV from dkv.
  auto gradient = [&](Backend& b, bool cuda_side, QkvParts& parts, int64_t& marker_bad) {
    std::vector<double> all;
    for (int ch = 0; ch < chunks; ++ch) {
      std::vector<double> g = download(b, cuda_side ? dq[ch].c() : dq[ch].r());
      const std::vector<double> kvg = download(b, cuda_side ? dkv[ch].c() : dkv[ch].r());
      const int64_t hpg = k.heads / k.groups;
      for (int64_t row = 0; row < crows; ++row)
        for (int64_t grp = 0; grp < k.groups; ++grp)
          for (int64_t j = 0; j < 2 * k.d; ++j) {
            double& x = g[static_cast<size_t>(row * rs + grp * (hpg + 2) * k.d + hpg * k.d + j)];
            marker_bad += x != 7.0;  // the block backward leaves dq's key/value parts alone
            x = kvg[static_cast<size_t>(row * kvc + grp * 2 * k.d + j)];
          }
      all.insert(all.end(), g.begin(), g.end());
    }
    parts = split_qkv(all, whole);
  };
  QkvParts got, blocks_ref;
  int64_t marker_bad = 0, ref_marker_bad = 0;
  gradient(be, true, got, marker_bad);
  gradient(ref(), false, blocks_ref, ref_marker_bad);
  CHECK(marker_bad == 0);
  CHECK(ref_marker_bad == 0);

  // The reference's whole-sequence attention: forward on the inputs, backward with the CUDA
  // forward's out and lse.
  Twin w_qkv = twin(kBf16, {k.b * S, rs}, qkv), w_dout = twin(kBf16, {k.b * S, oc}, dout);
  Twin w_out = twin_nan(kBf16, {k.b * S, oc}), w_lse = twin_nan(DType::f32, {k.b, k.heads, S});
  Twin w_out_in = twin(kBf16, {k.b * S, oc}, out_g), w_lse_in = twin(DType::f32, {k.b, k.heads, S}, lse_g);
  Twin w_dqkv = twin_nan(kBf16, {k.b * S, rs});
  ref().attention_forward(w_out.r(), w_lse.r(), w_qkv.r(), whole);
  ref().attention_backward(w_dqkv.r(), w_dout.r(), w_out_in.r(), w_lse_in.r(), w_qkv.r(), whole);
  const std::vector<double> whole_out = download(ref(), w_out.r()), whole_lse = download(ref(), w_lse.r());
  const QkvParts whole_grad = split_qkv(download(ref(), w_dqkv.r()), whole);

  const Errors vs_blocks{rel_err(out_g, out_r), max_abs_diff(lse_g, lse_r), rel_err(got.q, blocks_ref.q),
                         rel_err(got.k, blocks_ref.k), rel_err(got.v, blocks_ref.v)};
  check_errors(fmt::format("{} | vs reference blocks | {}", name, vs_blocks.text()), vs_blocks);
  const Errors vs_whole{rel_err(out_g, whole_out), max_abs_diff(lse_g, whole_lse), rel_err(got.q, whole_grad.q),
                        rel_err(got.k, whole_grad.k), rel_err(got.v, whole_grad.v)};
  check_errors(fmt::format("{} | vs reference whole sequence | {}", name, vs_whole.text()), vs_whole);
}

}  // namespace

TEST_CASE("CUDA context-parallel attention blocks match the reference", "[gpu][attention][cp]") {
  MT_RNG(rng);
  struct Named {
    Backend* be;
    const char* name;
  };
  const Named backends[] = {{&dev(), "auto"}, {&flash_backend(), "flash"}};
  for (int cp : {2, 3})
    for (int b : {1, 2})
      for (int c : {64, 37})
        for (auto [heads, groups] : {std::pair{8, 2}, std::pair{4, 4}})
          for (int d : {64, 128}) {
            const CpCase k{cp, b, c, heads, groups, d};
            for (const Named& n : backends) {
              if (n.be == backends[0].be && cp == 2 && b == 1)  // which implementation auto picked
                std::printf("%s | auto: %s; not causal: %s\n", k.name().c_str(),
                            cuda::describe_attention(AttentionShape::make(b, c, heads, groups, d), AttentionBackend::auto_, kBf16).c_str(),
                            cuda::describe_attention(AttentionShape::make(b, c, heads, groups, d, false),
                                                     AttentionBackend::auto_, kBf16).c_str());
              run_case(k, *n.be, n.name, rng);
            }
          }
}

// Packed documents (--reset-attention-mask under CP): documents that cross chunks, start inside
// them, and leave queries of a block with no key of it (a block of earlier keys masked wholly for
// some rows). cuDNN takes no documents, so auto runs the flash kernels (head dims 64 and 128) or the
// generic ones (96).
TEST_CASE("CUDA context-parallel attention blocks with packed documents match the reference",
          "[gpu][attention][cp][documents]") {
  MT_RNG(rng);
  for (int cp : {2, 3})
    for (int b : {1, 2})
      for (int c : {64, 37})
        for (int d : {64, 128, 96})
          for (int max_doc : {7, 50}) run_case(CpCase{cp, b, c, 8, 2, d, max_doc}, dev(), "auto", rng);
}

TEST_CASE("CUDA attention_merge matches the reference", "[gpu][attention][cp]") {
  MT_RNG(rng);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (DType dt : {DType::bf16, DType::f32})
    for (int d : {64, 36}) {  // 36: bf16 rows of 72 bytes, the element-wise path
      const int b = 2, heads = 4, s = 37;
      const int64_t rows = static_cast<int64_t>(b) * s, cols = static_cast<int64_t>(heads) * d;
      INFO(fmt::format("{} d={}", dtype_name(dt), d));
      std::vector<double> out = rng.normal(rows * cols), out_blk = rng.normal(rows * cols);
      std::vector<double> lse = rng.uniform(b * heads * s, -3, 3), lse_blk = rng.uniform(b * heads * s, -3, 3);
      // Rows that saw no key: on one side (its out is never read: NaN), the other, or both.
      int none_both = 0;
      for (int i = 0; i < b; ++i)
        for (int h = 0; h < heads; ++h)
          for (int t = 0; t < s; ++t) {
            const size_t li = static_cast<size_t>((i * heads + h) * s + t);
            const int64_t o = (static_cast<int64_t>(t) * b + i) * cols + static_cast<int64_t>(h) * d;
            const int kind = (t + h + i) % 5;  // 0: lse -inf, 1: lse_blk -inf, 2: both, else neither
            if (kind == 0 || kind == 2) {
              lse[li] = -kInf;
              for (int j = 0; j < d; ++j) out[static_cast<size_t>(o + j)] = nan;
            }
            if (kind == 1 || kind == 2) {
              lse_blk[li] = -kInf;
              for (int j = 0; j < d; ++j) out_blk[static_cast<size_t>(o + j)] = nan;
            }
            none_both += kind == 2;
          }
      Twin o = dt == DType::f32 ? twin_same(dt, {rows, cols}, out) : twin(dt, {rows, cols}, out);
      Twin ob = dt == DType::f32 ? twin_same(dt, {rows, cols}, out_blk) : twin(dt, {rows, cols}, out_blk);
      Twin l = twin(DType::f32, {b, heads, s}, lse), lb = twin(DType::f32, {b, heads, s}, lse_blk);
      dev().attention_merge(o.c(), l.c(), ob.c(), lb.c());
      ref().attention_merge(o.r(), l.r(), ob.r(), lb.r());
      const std::vector<double> got = download(dev(), o.c()), want = download(ref(), o.r());
      const std::vector<double> got_l = download(dev(), l.c()), want_l = download(ref(), l.r());
      const double err = rel_err(got, want);
      INFO("out relative error " << err);
      CHECK(err <= tol_for(dt));
      int64_t lse_bad = 0, zero_bad = 0;
      for (size_t i = 0; i < got_l.size(); ++i)
        lse_bad += !(got_l[i] == want_l[i] || std::abs(got_l[i] - want_l[i]) <= 1e-5);
      for (int i = 0; i < b; ++i)
        for (int h = 0; h < heads; ++h)
          for (int t = 0; t < s; ++t)
            if ((t + h + i) % 5 == 2) {
              const int64_t o0 = (static_cast<int64_t>(t) * b + i) * cols + static_cast<int64_t>(h) * d;
              for (int j = 0; j < d; ++j) zero_bad += got[static_cast<size_t>(o0 + j)] != 0.0;
              lse_bad += got_l[static_cast<size_t>((i * heads + h) * s + t)] != -kInf;
            }
      CHECK(none_both > 0);
      CHECK(lse_bad == 0);
      CHECK(zero_bad == 0);
    }
}

TEST_CASE("CUDA attention_kv_pack and attention_kv_unpack_add match the reference exactly", "[gpu][attention][cp]") {
  MT_RNG(rng);
  struct Shape_ {
    int b, s, heads, groups, d;
  };
  for (DType dt : {DType::bf16, DType::f32})
    for (const Shape_& sh : {Shape_{2, 37, 8, 2, 64}, Shape_{1, 5, 3, 3, 36}, Shape_{2, 9, 4, 1, 128}}) {
      const AttentionShape a = AttentionShape::make(sh.b, sh.s, sh.heads, sh.groups, sh.d);
      const int64_t rows = static_cast<int64_t>(sh.b) * sh.s, kvc = 2LL * sh.groups * sh.d;
      INFO(fmt::format("{} b={} s={} heads {}/{} d={}", dtype_name(dt), sh.b, sh.s, sh.heads, sh.groups, sh.d));
      auto make = [&](const Shape& shape, const std::vector<double>& v) {
        return dt == DType::f32 ? twin_same(dt, shape, v) : twin(dt, shape, v);
      };
      Twin qkv = make({rows, a.qkv_row_stride()}, rng.normal(rows * a.qkv_row_stride()));
      Twin kv = make({rows, kvc}, std::vector<double>(static_cast<size_t>(rows * kvc), std::nan("")));
      dev().attention_kv_pack(kv.c(), qkv.c(), a);
      ref().attention_kv_pack(kv.r(), qkv.r(), a);
      CHECK(download(dev(), kv.c()) == download(ref(), kv.r()));

      Twin dkv = make({rows, kvc}, rng.normal(rows * kvc));
      dev().attention_kv_unpack_add(qkv.c(), dkv.c(), a);
      ref().attention_kv_unpack_add(qkv.r(), dkv.r(), a);
      const std::vector<double> got = download(dev(), qkv.c()), want = download(ref(), qkv.r());
      int64_t bad = 0;  // the float32 sum rounded once to the dtype (and the query parts untouched)
      for (size_t i = 0; i < got.size(); ++i) bad += got[i] != round_to(dt, want[i]);
      CHECK(bad == 0);
    }
}

TEST_CASE("CUDA attention blocks: an empty block, and what they refuse", "[gpu][attention][cp]") {
  const AttentionShape ac = AttentionShape::make(2, 16, 4, 2, 64);
  dev().reserve_attention_blocks(ac, 16, kBf16);
  const int64_t rows = 2 * 16;
  Twin q = twin(kBf16, {rows, ac.qkv_row_stride()}, std::vector<double>(rows * ac.qkv_row_stride(), 0.5));
  Twin kv = twin(kBf16, {rows, 2LL * ac.groups * ac.head_dim}, std::vector<double>(rows * 2 * ac.groups * ac.head_dim, 0.5));
  Twin out = twin_nan(kBf16, {rows, 4LL * 64});
  Twin lse = twin_nan(DType::f32, {2, 4, 16});
  auto block = [](int64_t q_begin, int64_t k_begin, int kv_len) {
    AttentionBlock blk;
    blk.q_begin = q_begin;
    blk.k_begin = k_begin;
    blk.kv_len = kv_len;
    blk.seq_total = 64;
    return blk;
  };

  // Keys wholly after the queries: out = 0, lse = -inf, and no gradient.
  dev().attention_block_forward(out.c(), lse.c(), q.c(), kv.c(), ac, block(16, 32, 16));
  for (double x : download(dev(), out.c())) CHECK(x == 0.0);
  for (double x : download(dev(), lse.c())) CHECK(x == -kInf);

  // Partly visible (keys [8, 24) against queries [16, 32)), and keys of another count.
  CHECK_THROWS_AS(dev().attention_block_forward(out.c(), lse.c(), q.c(), kv.c(), ac, block(16, 8, 16)), Unsupported);
  CHECK_THROWS_AS(dev().attention_block_backward(q.c(), kv.c(), out.c(), out.c(), lse.c(), q.c(), kv.c(), ac,
                                                 block(16, 8, 16)),
                  Unsupported);
  CHECK_THROWS_AS(dev().attention_block_forward(out.c(), lse.c(), q.c(), kv.c().flat_slice(0, kv.c().numel() / 2), ac,
                                                block(16, 0, 8)),
                  Unsupported);
  CHECK_THROWS_AS(dev().reserve_attention_blocks(ac, 32, kBf16), Unsupported);
  // Sliding windows: at set-up and in the ops.
  AttentionShape windowed = ac;
  windowed.window_left = 8;
  CHECK_THROWS_AS(dev().reserve_attention_blocks(windowed, 16, kBf16), Unsupported);
  CHECK_THROWS_AS(dev().attention_block_forward(out.c(), lse.c(), q.c(), kv.c(), windowed, block(16, 16, 16)),
                  Unsupported);
  CHECK_THROWS_AS(dev().attention_block_forward(out.c(), lse.c(), q.c(), kv.c(), windowed, block(16, 0, 16)),
                  Unsupported);
}

// Dropout: the CUDA blocks draw their masks by block-local indices with a key of the block's
// positions (not the reference's global draws, so no comparison): forward and backward repeat bit
// for bit, dropout changes the output, and two blocks of the same values at other positions draw
// other masks.
TEST_CASE("CUDA attention blocks with dropout repeat and draw a mask per block", "[gpu][attention][cp]") {
  MT_RNG(rng);
  const AttentionShape ac = AttentionShape::make(2, 37, 8, 2, 64, true, 0.2f, 0x5eed);
  AttentionShape no_drop = ac;
  no_drop.dropout_p = 0;
  dev().reserve_attention_blocks(ac, ac.seq, kBf16);
  const int64_t rows = 2 * 37, rs = ac.qkv_row_stride(), oc = 8 * 64, kvc = 2 * 2 * 64;
  Twin q = twin(kBf16, {rows, rs}, rng.normal(rows * rs)), kv = twin(kBf16, {rows, kvc}, rng.normal(rows * kvc));
  Twin dout = twin(kBf16, {rows, oc}, rng.normal(rows * oc));
  auto block = [](int64_t q_begin, int64_t k_begin) {
    AttentionBlock blk;
    blk.q_begin = q_begin;
    blk.k_begin = k_begin;
    blk.kv_len = 37;
    blk.seq_total = 4 * 37;
    return blk;
  };
  struct Run {
    std::vector<double> out, lse, dq, dkv;
  };
  auto run = [&](const AttentionShape& a, const AttentionBlock& blk) {
    Twin out = twin_nan(kBf16, {rows, oc}), lse = twin_nan(DType::f32, {2, 8, 37});
    Twin dq = twin(kBf16, {rows, rs}, std::vector<double>(rows * rs, 0.0));
    Twin dkv = twin(kBf16, {rows, kvc}, std::vector<double>(rows * kvc, 0.0));
    dev().attention_block_forward(out.c(), lse.c(), q.c(), kv.c(), a, blk);
    dev().attention_block_backward(dq.c(), dkv.c(), dout.c(), out.c(), lse.c(), q.c(), kv.c(), a, blk);
    return Run{download(dev(), out.c()), download(dev(), lse.c()), download(dev(), dq.c()), download(dev(), dkv.c())};
  };
  for (const AttentionBlock& blk : {block(37, 37), block(111, 37)}) {  // diagonal, wholly earlier keys
    INFO("block of queries " << blk.q_begin << ", keys " << blk.k_begin);
    const Run a = run(ac, blk), b = run(ac, blk), plain = run(no_drop, blk);
    for (const auto* v : {&a.out, &a.lse, &a.dq, &a.dkv}) {
      int64_t bad = 0;
      for (double x : *v) bad += !std::isfinite(x);
      CHECK(bad == 0);
    }
    CHECK(a.out == b.out);
    CHECK(a.lse == b.lse);
    CHECK(a.dq == b.dq);
    CHECK(a.dkv == b.dkv);
    CHECK(max_abs_diff(a.lse, plain.lse) <= 1e-5);  // dropout acts on the probabilities, not the normalizer
    CHECK(a.out != plain.out);
  }
  // The same values as another pair of positions (both wholly visible): another mask.
  CHECK(run(ac, block(111, 37)).out != run(ac, block(74, 0)).out);
}

TEST_CASE("CUDA copy_columns matches the reference exactly", "[gpu][cp]") {
  MT_RNG(rng);
  for (DType dt : {DType::bf16, DType::f32})
    for (const auto& [rows, src_cols, dst_cols, src_col, dst_col, cols] :
         std::vector<std::array<int64_t, 6>>{{37, 96, 24, 48, 0, 24}, {5, 7, 9, 2, 3, 5}, {128, 64, 256, 0, 192, 64}}) {
      INFO(fmt::format("{} rows {} [{}, +{}) of {} into [{}, +{}) of {}", dtype_name(dt), rows, src_col, cols, src_cols,
                       dst_col, cols, dst_cols));
      Twin src = twin_same(dt, {rows, src_cols}, rng.normal(rows * src_cols));
      Twin dst = twin_same(dt, {rows, dst_cols}, rng.normal(rows * dst_cols));
      dev().copy_columns(dst.c(), dst_col, src.c(), src_col, cols);
      ref().copy_columns(dst.r(), dst_col, src.r(), src_col, cols);
      CHECK(download(dev(), dst.c()) == download(ref(), dst.r()));
    }
}
