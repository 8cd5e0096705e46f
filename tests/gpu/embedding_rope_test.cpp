// CUDA vs reference: token/position embedding forward and its deterministic backward (with a
// vocab shard and a heavily repeated token), and rotary embeddings on packed QKV.
#include <cmath>
#include <string>
#include <vector>

#include "tests/gpu/gpu_test_util.h"

using namespace mt;
using namespace mt::gputest;

namespace {
const DType kFloatTypes[] = {DType::f32, DType::bf16, DType::f16};

// Token ids in [0, vocab) where a third of the rows hold one token (a long run for one block).
std::vector<double> skewed_tokens(Rng& rng, int64_t n, int64_t vocab) {
  std::vector<double> t = rng.ints(n, 0, vocab);
  const std::vector<double> coin = rng.uniform(n, 0.0, 1.0);
  for (int64_t i = 0; i < n; ++i)
    if (coin[i] < 0.33) t[i] = 7;
  return t;
}
}  // namespace

TEST_CASE("cuda embedding forward/backward on vocab shards; backward is deterministic", "[gpu][embedding]") {
  MT_RNG(rng);
  const int64_t vocab = 1000, positions = 64;
  struct Case {
    int64_t rows, h;
  };
  for (DType dt : kFloatTypes)
    for (Case c : {Case{1, 48}, Case{7, 100}, Case{333, 768}, Case{2000, 64}, Case{129, 2050}})
      for (int64_t vocab_start : {int64_t{0}, int64_t{500}}) {
        const int64_t shard_rows = vocab - vocab_start;
        const bool with_wpe = vocab_start == 0;  // as the model passes it
        INFO(dtype_name(dt) << " rows " << c.rows << " h " << c.h << " vocab_start " << vocab_start);
        Twin tok = twin(DType::i32, {c.rows}, skewed_tokens(rng, c.rows, vocab));
        Twin pos = twin(DType::i32, {c.rows}, rng.ints(c.rows, 0, positions));
        Twin wte = twin(dt, {shard_rows, c.h}, rng.normal(shard_rows * c.h));
        Twin wpe = with_wpe ? twin(dt, {positions, c.h}, rng.normal(positions * c.h)) : absent();
        Twin out = twin_nan(dt, {c.rows, c.h});
        dev().embedding_forward(out.c(), tok.c(), pos.c(), wte.c(), wpe.c(), vocab_start);
        ref().embedding_forward(out.r(), tok.r(), pos.r(), wte.r(), wpe.r(), vocab_start);
        MT_CHECK_CLOSE(out, tol_for(dt));

        const std::vector<double> dwte0 = rng.normal(shard_rows * c.h), dwpe0 = rng.normal(positions * c.h);
        Twin dwte = twin(DType::f32, {shard_rows, c.h}, dwte0), dwpe = twin(DType::f32, {positions, c.h}, dwpe0);
        Twin dout = twin(dt, {c.rows, c.h}, rng.normal(c.rows * c.h));
        dev().embedding_backward(dwte.c(), dwpe.c(), dout.c(), tok.c(), pos.c(), vocab_start);
        ref().embedding_backward(dwte.r(), dwpe.r(), dout.r(), tok.r(), pos.r(), vocab_start);
        MT_CHECK_CLOSE(dwte, 1e-5);
        MT_CHECK_CLOSE(dwpe, 1e-5);
        const auto first_wte = download_bytes(dev(), dwte.c()), first_wpe = download_bytes(dev(), dwpe.c());
        upload(dev(), dwte.c(), dwte0);
        upload(dev(), dwpe.c(), dwpe0);
        dev().embedding_backward(dwte.c(), dwpe.c(), dout.c(), tok.c(), pos.c(), vocab_start);
        CHECK(differing(download_bytes(dev(), dwte.c()), first_wte, 4) == 0);
        CHECK(differing(download_bytes(dev(), dwpe.c()), first_wpe, 4) == 0);
      }
}

TEST_CASE("cuda rope forward/backward: half and interleaved pairs, partial rotation, GQA", "[gpu][rope]") {
  MT_RNG(rng);
  struct Case {
    int heads, groups, head_dim, rot_dim;
  };
  const int64_t table_rows = 256;
  for (DType dt : kFloatTypes)
    for (Case c : {Case{8, 2, 64, 64}, Case{4, 4, 64, 32}, Case{6, 1, 48, 24}, Case{2, 2, 128, 128}})
      for (bool interleaved : {false, true})
        for (int64_t rows : {1, 7, 333}) {
          INFO(dtype_name(dt) << " heads " << c.heads << " groups " << c.groups << " d " << c.head_dim << " rot "
                              << c.rot_dim << (interleaved ? " interleaved" : " half") << " rows " << rows);
          RopeShape r;
          r.heads = c.heads, r.groups = c.groups, r.head_dim = c.head_dim, r.rot_dim = c.rot_dim;
          r.interleaved = interleaved;
          const int64_t width = static_cast<int64_t>(c.groups) * (c.heads / c.groups + 2) * c.head_dim;
          std::vector<double> table(static_cast<size_t>(table_rows * c.rot_dim));
          for (int64_t p = 0; p < table_rows; ++p)
            for (int i = 0; i < c.rot_dim / 2; ++i) {
              const double angle = p * std::pow(10000.0, -2.0 * i / c.rot_dim);
              table[p * c.rot_dim + i] = std::cos(angle);
              table[p * c.rot_dim + c.rot_dim / 2 + i] = std::sin(angle);
            }
          Twin cs = twin(DType::f32, {table_rows, c.rot_dim}, table);
          Twin pos = twin(DType::i32, {rows}, rng.ints(rows, 0, table_rows));
          Twin qkv = twin(dt, {rows, width}, rng.normal(rows * width));
          dev().rope_forward(qkv.c(), pos.c(), cs.c(), r);
          ref().rope_forward(qkv.r(), pos.r(), cs.r(), r);
          MT_CHECK_CLOSE(qkv, tol_for(dt));
          Twin g = twin(dt, {rows, width}, rng.normal(rows * width));
          dev().rope_backward(g.c(), pos.c(), cs.c(), r);
          ref().rope_backward(g.r(), pos.r(), cs.r(), r);
          MT_CHECK_CLOSE(g, tol_for(dt));
        }
}

TEST_CASE("cuda MLA attention input forward/backward: packing, MLA RoPE, the shared key's gradient",
          "[gpu][rope][mla]") {
  MT_RNG(rng);
  const int64_t table_rows = 64;
  // (heads, d_nope, d_rope, rotated, d_v): DeepSeek-V3's per-rank shape, Megatron's test config,
  // odd sizes and a partial rotation.
  for (DType dt : kFloatTypes)
    for (MlaShape m : {MlaShape{16, 128, 64, 64, 128, 512}, MlaShape{4, 16, 8, 8, 16, 64}, MlaShape{3, 5, 6, 2, 4, 7},
                       MlaShape{1, 0, 2, 2, 2, 3}})
      for (int64_t rows : {1, 7, 129}) {
        INFO(dtype_name(dt) << " heads " << m.heads << " nope " << m.nope_dim << " rope " << m.rope_dim << " rot "
                            << m.rot_dim << " v " << m.v_dim << " rows " << rows);
        const int64_t down_cols = m.kr_col + m.rope_dim + 3;
        std::vector<double> table(static_cast<size_t>(table_rows * m.rot_dim));
        for (int64_t p = 0; p < table_rows; ++p)
          for (int i = 0; i < m.rot_dim / 2; ++i) {
            const double angle = p * std::pow(10000.0, -2.0 * i / m.rot_dim);
            table[p * m.rot_dim + i] = 1.2 * std::cos(angle);
            table[p * m.rot_dim + m.rot_dim / 2 + i] = 1.2 * std::sin(angle);
          }
        Twin cs = twin(DType::f32, {table_rows, m.rot_dim}, table);
        Twin pos = twin(DType::i32, {rows}, rng.ints(rows, 0, table_rows));
        Twin q = twin(dt, {rows, m.q_width()}, rng.normal(rows * m.q_width()));
        Twin kv = twin(dt, {rows, m.kv_width()}, rng.normal(rows * m.kv_width()));
        Twin down = twin(dt, {rows, down_cols}, rng.normal(rows * down_cols));
        Twin qkv = twin_nan(dt, {rows, m.qkv_width()});
        dev().mla_qkv_forward(qkv.c(), q.c(), kv.c(), down.c(), pos.c(), cs.c(), m);
        ref().mla_qkv_forward(qkv.r(), q.r(), kv.r(), down.r(), pos.r(), cs.r(), m);
        MT_CHECK_CLOSE(qkv, tol_for(dt));
        Twin g = twin(dt, {rows, m.qkv_width()}, rng.normal(rows * m.qkv_width()));
        Twin dq = twin_nan(dt, {rows, m.q_width()}), dkv = twin_nan(dt, {rows, m.kv_width()});
        Twin ddown = twin(dt, {rows, down_cols}, rng.normal(rows * down_cols));  // other columns kept
        dev().mla_qkv_backward(dq.c(), dkv.c(), ddown.c(), g.c(), pos.c(), cs.c(), m);
        ref().mla_qkv_backward(dq.r(), dkv.r(), ddown.r(), g.r(), pos.r(), cs.r(), m);
        MT_CHECK_CLOSE(dq, tol_for(dt));
        MT_CHECK_CLOSE(dkv, tol_for(dt));
        MT_CHECK_CLOSE(ddown, 4 * tol_for(dt));  // (a sum over the heads)
      }
}

// --grad-reduce-in-bf16: dwte and dwpe are bf16 gradients, each touched element round_bf16(old + the
// float32 sum of its rows), against the reference with bf16 gradients; deterministic.
TEST_CASE("cuda embedding_backward into bf16 gradients matches the reference", "[gpu][embedding][bf16grad]") {
  MT_RNG(rng);
  const int64_t vocab = 1000, positions = 64;
  struct Case {
    int64_t rows, h;
  };
  for (DType dt : {DType::bf16, DType::f32})
    for (Case c : {Case{7, 100}, Case{333, 768}, Case{2000, 64}, Case{129, 2050}, Case{77, 33}})
      for (int64_t vocab_start : {int64_t{0}, int64_t{500}}) {
        const int64_t shard_rows = vocab - vocab_start;
        INFO(dtype_name(dt) << " rows " << c.rows << " h " << c.h << " vocab_start " << vocab_start);
        Twin tok = twin(DType::i32, {c.rows}, skewed_tokens(rng, c.rows, vocab));
        Twin pos = twin(DType::i32, {c.rows}, rng.ints(c.rows, 0, positions));
        // Starting values of about one step's sums (a third of the rows share token 7).
        const double scale = std::sqrt(static_cast<double>(c.rows) / 3.0) + 1.0;
        const std::vector<double> dwte0 = rng.normal(shard_rows * c.h, scale), dwpe0 = rng.normal(positions * c.h, scale);
        Twin dwte = twin_same(DType::bf16, {shard_rows, c.h}, dwte0);
        Twin dwpe = twin_same(DType::bf16, {positions, c.h}, dwpe0);
        Twin dout = twin(dt, {c.rows, c.h}, rng.normal(c.rows * c.h));
        dev().embedding_backward(dwte.c(), dwpe.c(), dout.c(), tok.c(), pos.c(), vocab_start);
        ref().embedding_backward(dwte.r(), dwpe.r(), dout.r(), tok.r(), pos.r(), vocab_start);
        // The rows the batch touched against the reference (alone, so that the untouched rows do not
        // dilute the mean error); the others keep their starting bits.
        auto check_rows = [&](const Twin& g, const std::vector<double>& ids, int64_t offset,
                              const std::vector<double>& start, const char* name) {
          const int64_t n = g.c().rows(), h = g.c().cols();
          std::vector<char> touched(static_cast<size_t>(n), 0);
          for (double id : ids) {
            const int64_t k = static_cast<int64_t>(id) - offset;
            if (k >= 0 && k < n) touched[static_cast<size_t>(k)] = 1;
          }
          const std::vector<double> got = download(dev(), g.c()), want = download(ref(), g.r());
          std::vector<double> got_t, want_t;
          int64_t changed = 0;
          for (int64_t k = 0; k < n; ++k)
            for (int64_t j = 0; j < h; ++j) {
              const size_t e = static_cast<size_t>(k * h + j);
              if (touched[static_cast<size_t>(k)]) {
                got_t.push_back(got[e]);
                want_t.push_back(want[e]);
              } else {
                changed += got[e] != round_to(DType::bf16, start[e]);
              }
            }
          check_bf16_grad_close(got_t, want_t, std::string(name) + " (rows the batch touched)");
          INFO(name << ": untouched elements changed: " << changed);
          CHECK(changed == 0);
        };
        check_rows(dwte, download(ref(), tok.r()), vocab_start, dwte0, "dwte");
        check_rows(dwpe, download(ref(), pos.r()), 0, dwpe0, "dwpe");
        const auto first_wte = download_bytes(dev(), dwte.c()), first_wpe = download_bytes(dev(), dwpe.c());
        upload(dev(), dwte.c(), dwte0);
        upload(dev(), dwpe.c(), dwpe0);
        dev().embedding_backward(dwte.c(), dwpe.c(), dout.c(), tok.c(), pos.c(), vocab_start);
        CHECK(differing(download_bytes(dev(), dwte.c()), first_wte, 2) == 0);
        CHECK(differing(download_bytes(dev(), dwpe.c()), first_wpe, 2) == 0);
      }
}
