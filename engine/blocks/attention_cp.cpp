// Context-parallel attention (engine/blocks/attention_core.h): rank r of CP holds chunks r and
// 2 CP - 1 - r of each sequence (2 CP chunks of c positions); its queries meet every chunk of keys
// they can see, one block (c queries x c keys) at a time, and the blocks of a query chunk merge by
// their log-sum-exp. Which blocks a query chunk sees follows from global positions alone (causal,
// sliding window), so one loop serves every way the keys travel:
//   p2p        a ring over the CP group: each step's keys and values go on to the next rank while
//              the step's blocks compute;
//   allgather  all of them gathered first (their gradients reduce-scattered back);
//   a2a        Ulysses: an all-to-all turns this rank's positions of all heads into all positions
//              of heads / CP heads (and back for the output), then the blocks run locally;
//   a2a+p2p    the all-to-all inside groups of A consecutive CP ranks, then a ring over the CP / A
//              groups (--hierarchical-context-parallel-sizes A P).
//
// Backward recomputes nothing across ranks beyond the keys and values: each block's backward
// takes the merged output and lse of its queries (as flash attention's backward does), adds its dQ
// to the queries' gradient and its dK, dV to the gradient of the key chunk it used, which then
// travels back to the chunk's owner (the ring passes it on with the keys; the all-gather
// reduce-scatters it; the all-to-all returns it with dQ).
#include <algorithm>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/philox.h"
#include "engine/blocks/attention_core.h"

namespace mt {

namespace {

class ContextParallelAttention final : public AttentionCore {
 public:
  ContextParallelAttention(Backend& be, Communicator& cp, int cp_rank, CpCommType type, int a2a_size,
                           const CpBuffers& buf)
      : be_(be), cp_(cp), rank_(cp_rank), size_(cp.size()), type_(type), buf_(buf) {
    MT_CHECK(cp.rank() == cp_rank && size_ > 1, "context-parallel rank {} of {} (group rank {})", cp_rank, size_,
             cp.rank());
    a2a_ = type == CpCommType::a2a ? size_ : type == CpCommType::a2a_p2p ? a2a_size : 1;
    MT_CHECK(a2a_ >= 1 && size_ % a2a_ == 0, "a2a size {} of CP {}", a2a_, size_);
    first_.assign(static_cast<size_t>(2 * a2a_), 1);
    // (Collective over the CP group: every member builds its cores in the same order.)
    if (a2a_ > 1 && a2a_ < size_) {
      inner_own_ = cp.split(rank_ / a2a_, rank_ % a2a_, "cp_a2a");
      outer_own_ = cp.split(rank_ % a2a_, rank_ / a2a_, "cp_ring");
    }
    inner_ = a2a_ == 1 ? nullptr : a2a_ == size_ ? &cp_ : inner_own_.get();
    outer_ = a2a_ == size_ ? nullptr : a2a_ == 1 ? &cp_ : outer_own_.get();
    // The ring's transfers on the backend's TP communication stream (CUDA), beside the blocks that
    // compute meanwhile; the reference backend's are synchronous (no stream: the ring itself).
    if (outer_ && be.tp_comm_stream()) {
      ring_own_ = outer_->split(0, outer_->rank(), "cp_ring_stream");
      ring_own_->set_stream(be.tp_comm_stream());
    }
    ring_ = ring_own_ ? ring_own_.get() : outer_;
  }

  void reserve(const AttentionShape& a, AttentionBackend backend, DType dtype) override {
    MT_CHECK(a.seq % 2 == 0, "context parallelism: {} positions per rank do not split into two chunks", a.seq);
    if (a.heads % a2a_ != 0 || a.groups % a2a_ != 0)
      fail("--cp-comm-type a2a splits the heads over {} ranks: the {} query heads and {} query groups of a tensor-"
           "parallel rank must both be divisible by it", a2a_, a.heads, a.groups);
    // The blocks' attention (--attention-backend), then what the blocks add to it.
    be_.reserve_attention(block_shape(a), backend, dtype);
    be_.reserve_attention_blocks(block_shape(a), a.seq / 2, dtype);
  }

  void forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a, const AttentionSinks& sinks) override {
    const AttentionShape ac = block_shape(a);
    const Tensor x = to_heads(qkv, buf_.x, a.qkv_row_stride());  // [A R, qkv / A]: this rank's heads
    const Tensor xo = a2a_ > 1 ? buf_.x_out.view({a2a_ * a.batch * int64_t{a.seq}, ac.heads * int64_t{ac.head_dim}}) : out;
    std::fill(first_.begin(), first_.end(), 1);
    std::vector<char>& first = first_;
    // One key chunk (global index `chunk`, its rows in kv) against every query chunk here.
    auto blocks = [&](Tensor kv, int64_t chunk) {
      for (int qc = 0; qc < 2 * a2a_; ++qc) {
        const int64_t qi = query_chunk(qc);
        if (!visible(a, qi, chunk)) continue;
        const AttentionBlock blk = block(ac, qi, chunk);
        const Tensor q = x.row_slice(qc * rows(ac), rows(ac));
        if (first[static_cast<size_t>(qc)]) {  // a query chunk's first block writes, later ones merge
          be_.attention_block_forward(xo.row_slice(qc * rows(ac), rows(ac)), lse_chunk(lse, ac, qc), q, kv, ac, blk);
          first[static_cast<size_t>(qc)] = 0;
        } else {
          const Tensor ob = block_out(ac), lb = lse_chunk(buf_.lse_blk, ac, 0);
          be_.attention_block_forward(ob, lb, q, kv, ac, blk);
          be_.attention_merge(xo.row_slice(qc * rows(ac), rows(ac)), lse_chunk(lse, ac, qc), ob, lb);
        }
      }
    };
    const Tensor kv0 = kv_view(buf_.kv[0], ac);
    be_.attention_kv_pack(kv0, x, head_shape(a));
    if (type_ == CpCommType::allgather) {
      cp_.all_gather(buf_.kv_all, kv0);
      for (int owner = 0; owner < size_; ++owner)
        for (int kc = 0; kc < 2; ++kc) blocks(buf_.kv_all.row_slice((2 * int64_t{owner} + kc) * rows(ac), rows(ac)),
                                              owned_chunk(owner, kc));
    } else {
      // The ring over the groups (a group of one with a2a alone): step i holds group g - i's keys.
      // The next step's keys travel while this step's blocks compute.
      const int P = ring_size();
      int cur = 0;
      for (int step = 0; step < P; ++step) {
        const Tensor kv = kv_view(buf_.kv[cur], ac);
        if (step > 0) be_.compute_wait_for_tp_comm();  // (the keys received during the last step)
        if (step + 1 < P) exchange({kv}, {kv_view(buf_.kv[1 - cur], ac)});
        const int group = (ring_rank() - step + P) % P;
        for (int kc = 0; kc < 2 * a2a_; ++kc) blocks(kv.row_slice(kc * rows(ac), rows(ac)), group_chunk(group, kc));
        cur = 1 - cur;
      }
    }
    // The sinks join each query chunk's merged blocks (this rank's heads under a2a).
    if (sinks.enabled)
      for (int qc = 0; qc < 2 * a2a_; ++qc)
        be_.attention_sink_forward(xo.row_slice(qc * rows(ac), rows(ac)), lse_chunk(lse, ac, qc), own_heads(sinks.logits, ac));
    if (a2a_ > 1) to_seq(out, xo, ac.heads * int64_t{ac.head_dim});
  }

  void backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a,
                const AttentionSinks& sinks) override {
    const AttentionShape ac = block_shape(a);
    // This rank's heads again (the workspace served other layers since forward).
    const Tensor x = to_heads(qkv, buf_.x, a.qkv_row_stride());
    const int64_t hd = ac.heads * int64_t{ac.head_dim};
    const Tensor xo = a2a_ > 1 ? to_heads(out, buf_.x_out, hd * a2a_) : out;
    const Tensor xdo = a2a_ > 1 ? to_heads(dout, buf_.x_dout, hd * a2a_) : dout;
    const Tensor dx = a2a_ > 1 ? buf_.x_dqkv.view({x.rows(), x.cols()}) : dqkv;
    // The sinks' gradient from every query chunk here (under a2a: this rank's heads over the a2a
    // group's positions; the other heads' parts come from the group's other ranks, and the sum of
    // gradients over CP adds them).
    if (sinks.enabled && !sinks.grad.empty())
      for (int qc = 0; qc < 2 * a2a_; ++qc) {
        const int64_t r0 = qc * rows(ac);
        be_.attention_sink_backward(own_heads(sinks.grad, ac), xdo.row_slice(r0, rows(ac)), xo.row_slice(r0, rows(ac)),
                                    lse_chunk(lse, ac, qc), own_heads(sinks.logits, ac));
      }
    be_.fill(dx, 0.0);
    // One key chunk's blocks: dQ into dx, dK and dV into dkv (the chunk's gradient rows).
    auto blocks = [&](Tensor kv, Tensor dkv, int64_t chunk) {
      for (int qc = 0; qc < 2 * a2a_; ++qc) {
        const int64_t qi = query_chunk(qc);
        if (!visible(a, qi, chunk)) continue;
        const int64_t r0 = qc * rows(ac);
        be_.attention_block_backward(dx.row_slice(r0, rows(ac)), dkv, xdo.row_slice(r0, rows(ac)),
                                     xo.row_slice(r0, rows(ac)), lse_chunk(lse, ac, qc), x.row_slice(r0, rows(ac)), kv,
                                     ac, block(ac, qi, chunk));
      }
    };
    const Tensor kv0 = kv_view(buf_.kv[0], ac), dkv0 = kv_view(buf_.dkv[0], ac);
    be_.attention_kv_pack(kv0, x, head_shape(a));
    if (type_ == CpCommType::allgather) {
      cp_.all_gather(buf_.kv_all, kv0);
      be_.fill(buf_.dkv_all, 0.0);
      for (int owner = 0; owner < size_; ++owner)
        for (int kc = 0; kc < 2; ++kc) {
          const int64_t r0 = (2 * int64_t{owner} + kc) * rows(ac);
          blocks(buf_.kv_all.row_slice(r0, rows(ac)), buf_.dkv_all.row_slice(r0, rows(ac)), owned_chunk(owner, kc));
        }
      cp_.reduce_scatter(dkv0, buf_.dkv_all);
      be_.attention_kv_unpack_add(dx, dkv0, head_shape(a));
    } else {
      // The ring: step i holds group g - i's keys and the gradient of them summed over groups
      // g - i ... g - 1; it adds its own and passes both on. After the last step the gradient
      // travels one more hop, to its owner.
      // The next step's keys travel while this step's blocks compute; their gradient, complete
      // only after the blocks, follows.
      const int P = ring_size();
      be_.fill(dkv0, 0.0);
      int cur = 0;
      for (int step = 0; step < P; ++step) {
        const Tensor kv = kv_view(buf_.kv[cur], ac), dkv = kv_view(buf_.dkv[cur], ac);
        if (step > 0) be_.compute_wait_for_tp_comm();
        if (step + 1 < P) exchange({kv}, {kv_view(buf_.kv[1 - cur], ac)});
        const int group = (ring_rank() - step + P) % P;
        for (int kc = 0; kc < 2 * a2a_; ++kc) {
          const int64_t r0 = kc * rows(ac);
          blocks(kv.row_slice(r0, rows(ac)), dkv.row_slice(r0, rows(ac)), group_chunk(group, kc));
        }
        if (P > 1) exchange({dkv}, {kv_view(buf_.dkv[1 - cur], ac)});
        cur = 1 - cur;
      }
      if (P > 1) be_.compute_wait_for_tp_comm();
      be_.attention_kv_unpack_add(dx, kv_view(buf_.dkv[P > 1 ? cur : 0], ac), head_shape(a));
    }
    if (a2a_ > 1) to_seq(dqkv, dx, a.qkv_row_stride() / a2a_);
  }

 private:
  // The heads one rank attends to after the all-to-all (all of them without one), over this
  // rank's positions: the shape kv_pack and kv_unpack_add take for A R rows (as A samples' worth).
  AttentionShape head_shape(const AttentionShape& a) const {
    AttentionShape h = a;
    h.heads = a.heads / a2a_;
    h.groups = a.groups / a2a_;
    h.batch = a.batch * a2a_;
    return h;
  }
  // A block's shape: c queries (a chunk) of this rank's heads.
  AttentionShape block_shape(const AttentionShape& a) const {
    AttentionShape ac = a;
    ac.seq = a.seq / 2;
    ac.heads = a.heads / a2a_;
    ac.groups = a.groups / a2a_;
    // Each member of an a2a group draws dropout for its own slice of the heads.
    if (a2a_ > 1) ac.dropout_key = mix_key(a.dropout_key, 0x6132ULL + static_cast<uint64_t>(rank_ % a2a_));
    return ac;
  }
  static int64_t rows(const AttentionShape& ac) { return static_cast<int64_t>(ac.batch) * ac.seq; }
  // Key/value rows of [rows, groups * 2 * d] in a buffer planned for all heads.
  static Tensor kv_view(const Tensor& t, const AttentionShape& ac) {
    const int64_t cols = 2 * int64_t{ac.groups} * ac.head_dim;
    return t.view({t.numel() / cols, cols});
  }
  int ring_size() const { return size_ / a2a_; }
  int ring_rank() const { return rank_ / a2a_; }
  // Global chunk index of rank `owner`'s local chunk (0 or 1).
  int64_t owned_chunk(int owner, int local) const { return local == 0 ? owner : 2 * int64_t{size_} - 1 - owner; }
  // Chunk kc (of 2 A) of a2a group `group`: member kc / 2's local chunk kc % 2.
  int64_t group_chunk(int group, int kc) const { return owned_chunk(group * a2a_ + kc / 2, kc % 2); }
  int64_t query_chunk(int qc) const { return group_chunk(ring_rank(), qc); }
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
  // One block's output (scratch for the merge) of this rank's heads.
  Tensor block_out(const AttentionShape& ac) const {
    const int64_t cols = ac.heads * int64_t{ac.head_dim};
    return buf_.out_blk.flat_slice(0, rows(ac) * cols).view({rows(ac), cols});
  }
  // A per-head vector's part for the heads this rank attends with (a2a: its member index's heads
  // / A; else all); an empty one stays empty.
  Tensor own_heads(Tensor v, const AttentionShape& ac) const {
    if (a2a_ == 1 || v.empty()) return v;
    return v.flat_slice(static_cast<int64_t>(rank_ % a2a_) * ac.heads, ac.heads);
  }
  // The lse of query chunk qc, laid out per chunk: [2 A][b, heads / A, c].
  static Tensor lse_chunk(Tensor lse, const AttentionShape& ac, int qc) {
    const int64_t n = static_cast<int64_t>(ac.batch) * ac.heads * ac.seq;
    return lse.flat_slice(qc * n, n).view({ac.batch, ac.heads, ac.seq});
  }
  // a2a: t [R, A w] (this rank's rows, all heads) -> dst [A R, w] (the a2a group's rows, this
  // rank's w columns: member j's rows j-th); without a2a, t itself.
  Tensor to_heads(Tensor t, Tensor dst, int64_t width) {
    if (a2a_ == 1) return t;
    const int64_t R = t.numel() / width, w = width / a2a_;
    const Tensor stage = buf_.stage.flat_slice(0, R * width);
    for (int j = 0; j < a2a_; ++j) be_.copy_columns(stage.flat_slice(j * R * w, R * w).view({R, w}), 0, t.view({R, width}), j * w, w);
    const Tensor out = dst.flat_slice(0, R * width).view({a2a_ * R, w});
    all_to_all(out, stage);
    return out;
  }
  // The inverse: src [A R, w] -> dst [R, A w].
  void to_seq(Tensor dst, Tensor src, int64_t w) {
    const int64_t R = src.rows() / a2a_;
    const Tensor stage = buf_.stage.flat_slice(0, src.numel());
    all_to_all(stage, src);
    for (int j = 0; j < a2a_; ++j) be_.copy_columns(dst.view({R, a2a_ * w}), j * w, stage.flat_slice(j * R * w, R * w).view({R, w}), 0, w);
  }
  // recv's part j = member j's part `me` of send (equal parts, rank-major).
  void all_to_all(Tensor recv, Tensor send) {
    Communicator& c = *inner_;
    const int64_t part = send.numel() / a2a_;
    const int me = c.rank();
    c.group_start();
    for (int j = 0; j < a2a_; ++j) {
      if (j == me) continue;
      c.send(send.flat_slice(j * part, part), j);
      c.recv(recv.flat_slice(j * part, part), j);
    }
    c.group_end();
    be_.copy(recv.flat_slice(me * part, part), send.flat_slice(me * part, part));
  }
  // Sends `send` to the next rank of the ring and receives `recv` from the previous one, as one
  // group, once the compute stream has written what it sends (and read what it receives into).
  void exchange(std::initializer_list<Tensor> send, std::initializer_list<Tensor> recv) {
    const int P = ring_size(), me = ring_rank();
    const int next = (me + 1) % P, prev = (me - 1 + P) % P;
    be_.tp_comm_wait_for_compute();
    ring_->group_start();
    for (const Tensor& t : send) ring_->send(t, next);
    for (const Tensor& t : recv) ring_->recv(t, prev);
    ring_->group_end();
  }

  Backend& be_;
  Communicator& cp_;
  int rank_, size_;
  CpCommType type_;
  int a2a_ = 1;
  std::unique_ptr<Communicator> inner_own_, outer_own_, ring_own_;
  Communicator* inner_ = nullptr;  // the all-to-all's group (A consecutive CP ranks)
  Communicator* outer_ = nullptr;  // the ring's (the CP ranks at the same place of each group)
  Communicator* ring_ = nullptr;   // outer_, or its copy on the TP communication stream
  const CpBuffers& buf_;
  std::vector<char> first_;  // forward: whether each query chunk's first block is still to come
};

}  // namespace

std::unique_ptr<AttentionCore> make_context_parallel_attention(Backend& backend, Communicator& cp, int cp_rank,
                                                               CpCommType type, int a2a_size, const CpBuffers& buffers) {
  return std::make_unique<ContextParallelAttention>(backend, cp, cp_rank, type, a2a_size, buffers);
}

}  // namespace mt
