// Context-parallel attention (engine/blocks/attention_core.h): rank r of CP holds chunks r and
// 2 CP - 1 - r of each sequence (2 CP chunks of c positions); its queries meet every chunk of keys
// they can see, one block (c queries x c keys) at a time, and the blocks of a query chunk merge by
// their log-sum-exp. Which blocks a query chunk sees follows from global positions alone (causal,
// sliding window), so the same loop serves the ring, the all-gather and any split.
//
// Backward recomputes nothing across ranks beyond the keys and values: each block's backward
// takes the merged output and lse of its queries (as flash attention's backward does), adds its dQ
// to this rank's QKV gradient and its dK, dV to the gradient of the key chunk it used, which then
// travels back to the chunk's owner (the ring passes it on with the keys; the all-gather
// reduce-scatters it).
#include <utility>

#include "core/error.h"
#include "engine/blocks/attention_core.h"

namespace mt {

namespace {

class ContextParallelAttention final : public AttentionCore {
 public:
  ContextParallelAttention(Backend& be, Communicator& cp, int cp_rank, CpCommType type, const CpBuffers& buf)
      : be_(be), cp_(cp), rank_(cp_rank), size_(cp.size()), type_(type), buf_(buf) {
    MT_CHECK(type == CpCommType::p2p || type == CpCommType::allgather, "context-parallel comm type {} not built",
             static_cast<int>(type));
    MT_CHECK(cp.rank() == cp_rank && size_ > 1, "context-parallel rank {} of {} (group rank {})", cp_rank, size_,
             cp.rank());
  }

  void reserve(const AttentionShape& a, AttentionBackend, DType dtype) override {
    MT_CHECK(a.seq % 2 == 0, "context parallelism: {} positions per rank do not split into two chunks", a.seq);
    be_.reserve_attention_blocks(chunk_shape(a), a.seq / 2, dtype);
  }

  void forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a) override {
    const AttentionShape ac = chunk_shape(a);
    bool first[2] = {true, true};
    // One key chunk (global index `chunk`, its rows in kv) against both query chunks.
    auto blocks = [&](Tensor kv, int64_t chunk) {
      for (int qc = 0; qc < 2; ++qc) {
        const int64_t qi = query_chunk(qc);
        if (!visible(a, qi, chunk)) continue;
        const AttentionBlock blk = block(ac, qi, chunk);
        const Tensor q = qkv.row_slice(qc * rows(ac), rows(ac));
        if (first[qc]) {  // every query chunk sees its own chunk first: it writes, later blocks merge
          be_.attention_block_forward(out_chunk(out, ac, qc), lse_chunk(lse, ac, qc), q, kv, ac, blk);
          first[qc] = false;
        } else {
          be_.attention_block_forward(buf_.out_blk, buf_.lse_blk, q, kv, ac, blk);
          be_.attention_merge(out_chunk(out, ac, qc), lse_chunk(lse, ac, qc), buf_.out_blk, buf_.lse_blk);
        }
      }
    };
    if (type_ == CpCommType::allgather) {
      be_.attention_kv_pack(buf_.kv[0], qkv, a);
      cp_.all_gather(buf_.kv_all, buf_.kv[0]);
      for_each_gathered_chunk(ac, [&](int64_t r0, int64_t chunk) { blocks(buf_.kv_all.row_slice(r0, rows(ac)), chunk); });
      return;
    }
    // The ring: step i holds the keys of rank r - i, and passes them on while computing.
    be_.attention_kv_pack(buf_.kv[0], qkv, a);
    int cur = 0;
    for (int step = 0; step < size_; ++step) {
      const int owner = (rank_ - step + size_) % size_;
      if (step + 1 < size_) exchange({buf_.kv[cur]}, {buf_.kv[1 - cur]});
      for (int kc = 0; kc < 2; ++kc) blocks(buf_.kv[cur].row_slice(kc * rows(ac), rows(ac)), owned_chunk(owner, kc));
      cur = 1 - cur;
    }
  }

  void backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a) override {
    const AttentionShape ac = chunk_shape(a);
    be_.fill(dqkv, 0.0);
    // One key chunk's blocks: dQ into dqkv, dK and dV into dkv (the chunk's gradient rows).
    auto blocks = [&](Tensor kv, Tensor dkv, int64_t chunk) {
      for (int qc = 0; qc < 2; ++qc) {
        const int64_t qi = query_chunk(qc);
        if (!visible(a, qi, chunk)) continue;
        const int64_t r0 = qc * rows(ac);
        be_.attention_block_backward(dqkv.row_slice(r0, rows(ac)), dkv, dout.row_slice(r0, rows(ac)),
                                     out_chunk(out, ac, qc), lse_chunk(lse, ac, qc), qkv.row_slice(r0, rows(ac)), kv,
                                     ac, block(ac, qi, chunk));
      }
    };
    be_.attention_kv_pack(buf_.kv[0], qkv, a);  // (the workspace served other layers since forward)
    if (type_ == CpCommType::allgather) {
      cp_.all_gather(buf_.kv_all, buf_.kv[0]);
      be_.fill(buf_.dkv_all, 0.0);
      for_each_gathered_chunk(ac, [&](int64_t r0, int64_t chunk) {
        blocks(buf_.kv_all.row_slice(r0, rows(ac)), buf_.dkv_all.row_slice(r0, rows(ac)), chunk);
      });
      cp_.reduce_scatter(buf_.dkv[0], buf_.dkv_all);
      be_.attention_kv_unpack_add(dqkv, buf_.dkv[0], a);
      return;
    }
    // The ring: step i holds rank r - i's keys and the gradient of them summed over ranks r - i ...
    // r - 1; it adds its own and passes both on. After the last step the gradient travels one more
    // hop, to its owner.
    be_.fill(buf_.dkv[0], 0.0);
    int cur = 0;
    for (int step = 0; step < size_; ++step) {
      const int owner = (rank_ - step + size_) % size_;
      for (int kc = 0; kc < 2; ++kc) {
        const int64_t r0 = kc * rows(ac);
        blocks(buf_.kv[cur].row_slice(r0, rows(ac)), buf_.dkv[cur].row_slice(r0, rows(ac)), owned_chunk(owner, kc));
      }
      if (step + 1 < size_) exchange({buf_.kv[cur], buf_.dkv[cur]}, {buf_.kv[1 - cur], buf_.dkv[1 - cur]});
      else exchange({buf_.dkv[cur]}, {buf_.dkv[1 - cur]});
      cur = 1 - cur;
    }
    be_.attention_kv_unpack_add(dqkv, buf_.dkv[cur], a);
  }

 private:
  // A block's shape: c queries (the chunk) of the layer's shape.
  static AttentionShape chunk_shape(const AttentionShape& a) {
    AttentionShape ac = a;
    ac.seq = a.seq / 2;
    return ac;
  }
  static int64_t rows(const AttentionShape& ac) { return static_cast<int64_t>(ac.batch) * ac.seq; }
  // Global chunk index of this rank's local chunk qc (0 or 1), and of rank `owner`'s.
  int64_t owned_chunk(int owner, int local) const { return local == 0 ? owner : 2 * int64_t{size_} - 1 - owner; }
  int64_t query_chunk(int local) const { return owned_chunk(rank_, local); }
  // Whether any query of chunk qi sees any key of chunk ki (c positions each).
  static bool visible(const AttentionShape& a, int64_t qi, int64_t ki) {
    if (!a.causal) return true;
    const int64_t c = a.seq / 2;
    if (ki > qi) return false;
    return !a.windowed() || ki * c + c - 1 >= qi * c - a.window_left;
  }
  AttentionBlock block(const AttentionShape& ac, int64_t qi, int64_t ki) const {
    AttentionBlock b;
    b.q_begin = qi * ac.seq;
    b.k_begin = ki * ac.seq;
    b.kv_len = ac.seq;
    b.seq_total = 2 * int64_t{size_} * ac.seq;
    return b;
  }
  Tensor out_chunk(Tensor out, const AttentionShape& ac, int qc) const {
    return out.row_slice(qc * rows(ac), rows(ac));
  }
  Tensor lse_chunk(Tensor lse, const AttentionShape& ac, int qc) const {
    const int64_t n = static_cast<int64_t>(ac.batch) * ac.heads * ac.seq;
    return lse.flat_slice(qc * n, n).view({ac.batch, ac.heads, ac.seq});
  }
  // allgather: every rank's two chunks, by their first row in kv_all's rank-major rows.
  template <class F>
  void for_each_gathered_chunk(const AttentionShape& ac, F&& f) {
    for (int owner = 0; owner < size_; ++owner)
      for (int kc = 0; kc < 2; ++kc) f((2 * int64_t{owner} + kc) * rows(ac), owned_chunk(owner, kc));
  }
  // Sends `send` to the next rank of the ring and receives `recv` from the previous one, as one group.
  void exchange(std::initializer_list<Tensor> send, std::initializer_list<Tensor> recv) {
    const int next = (rank_ + 1) % size_, prev = (rank_ - 1 + size_) % size_;
    cp_.group_start();
    for (const Tensor& t : send) cp_.send(t, next);
    for (const Tensor& t : recv) cp_.recv(t, prev);
    cp_.group_end();
  }

  Backend& be_;
  Communicator& cp_;
  int rank_, size_;
  CpCommType type_;
  const CpBuffers& buf_;
};

}  // namespace

std::unique_ptr<AttentionCore> make_context_parallel_attention(Backend& backend, Communicator& cp, int cp_rank,
                                                               CpCommType type, const CpBuffers& buffers) {
  return std::make_unique<ContextParallelAttention>(backend, cp, cp_rank, type, buffers);
}

}  // namespace mt
