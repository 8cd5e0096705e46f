#include "parallel/mpi_communicator.h"

#include <mpi.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace mt {
namespace {

using Clock = std::chrono::steady_clock;

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return std::string(text, static_cast<size_t>(len));
}

void check_mpi(int code, const std::string& what) {
  if (code != MPI_SUCCESS) fail("MPI error in {}: {}", what, mpi_error_string(code));
}

// --- 16-bit float reductions: MPI has no bf16/f16 arithmetic, so user-defined ops do it in f32.
template <float (*ToF)(uint16_t), uint16_t (*FromF)(float), int Op>
void reduce_16bit(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = ToF(a[i]), y = ToF(b[i]);
    const float r = Op == 0 ? x + y : Op == 1 ? std::max(x, y) : std::min(x, y);
    b[i] = FromF(r);
  }
}
uint16_t bf16_from_float(float f) { return float_to_bf16_bits(f); }
float bf16_to_float(uint16_t h) { return bf16_bits_to_float(h); }
uint16_t f16_from_float(float f) { return float_to_f16_bits(f); }
float f16_to_float(uint16_t h) { return f16_bits_to_float(h); }

MPI_Op g_16bit_ops[2][3] = {{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}, {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}};

void create_16bit_ops() {
  MPI_Op_create(&reduce_16bit<bf16_to_float, bf16_from_float, 0>, 1, &g_16bit_ops[0][0]);
  MPI_Op_create(&reduce_16bit<bf16_to_float, bf16_from_float, 1>, 1, &g_16bit_ops[0][1]);
  MPI_Op_create(&reduce_16bit<bf16_to_float, bf16_from_float, 2>, 1, &g_16bit_ops[0][2]);
  MPI_Op_create(&reduce_16bit<f16_to_float, f16_from_float, 0>, 1, &g_16bit_ops[1][0]);
  MPI_Op_create(&reduce_16bit<f16_to_float, f16_from_float, 1>, 1, &g_16bit_ops[1][1]);
  MPI_Op_create(&reduce_16bit<f16_to_float, f16_from_float, 2>, 1, &g_16bit_ops[1][2]);
}

int op_index(ReduceOp op) { return op == ReduceOp::sum ? 0 : op == ReduceOp::max ? 1 : 2; }

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    case DType::u8: return MPI_UINT8_T;
    case DType::i16: return MPI_INT16_T;
    case DType::fp8_e4m3:
    case DType::fp8_e5m2: return MPI_UINT8_T;  // moved as bits (FP8 tensors are gathered, never reduced)
    case DType::bf16:
    case DType::f16: return MPI_UINT16_T;  // moved as bits; reduced by the ops above
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(DType t, ReduceOp op) {
  if (t == DType::bf16) return g_16bit_ops[0][op_index(op)];
  if (t == DType::f16) return g_16bit_ops[1][op_index(op)];
  switch (op) {
    case ReduceOp::sum: return MPI_SUM;
    case ReduceOp::max: return MPI_MAX;
    case ReduceOp::min: return MPI_MIN;
  }
  return MPI_OP_NULL;
}

const char* op_name(ReduceOp op) { return op == ReduceOp::sum ? "sum" : op == ReduceOp::max ? "max" : "min"; }

int g_world_rank = 0;

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::string name, SharedTimeout timeout)
      : comm_(comm), name_(std::move(name)), timeout_(std::move(timeout)) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    // World ranks of the members, for error messages.
    MPI_Group group, world_group;
    MPI_Comm_group(comm_, &group);
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    std::vector<int> local(size_);
    for (int i = 0; i < size_; ++i) local[i] = i;
    world_ranks_.resize(size_);
    MPI_Group_translate_ranks(group, size_, local.data(), world_group, world_ranks_.data());
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
  }
  ~MpiCommunicator() override {
    // A communicator whose last operation timed out is left alone: freeing it may block.
    if (comm_ != MPI_COMM_WORLD && !broken_ && mpi_initialized()) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return name_; }

  void all_reduce(Tensor t, ReduceOp op) override {
    check_host(t, "all_reduce");
    const std::string what = fmt::format("all_reduce({}, {} x {})", op_name(op), t.numel(), dtype_name(t.dtype));
    MPI_Request req;
    check_mpi(MPI_Iallreduce(MPI_IN_PLACE, t.data, count(t), mpi_type(t.dtype), mpi_op(t.dtype, op), comm_, &req),
              context(what));
    wait_one(req, what);
  }

  void reduce_scatter(Tensor out, Tensor in, ReduceOp op) override {
    check_host(out, "reduce_scatter");
    check_host(in, "reduce_scatter");
    MT_CHECK(out.dtype == in.dtype && in.numel() == out.numel() * size_, "{}: reduce_scatter sizes {} x {} != {}",
             name_, out.numel(), size_, in.numel());
    const std::string what =
        fmt::format("reduce_scatter({}, {} x {} per rank)", op_name(op), out.numel(), dtype_name(out.dtype));
    // The output may alias the input (NCCL's in-place form: out = in + rank * count): reduce into a
    // scratch buffer then.
    const bool overlap = overlaps(out, in);
    void* dst = out.data;
    if (overlap) {
      scratch_.resize(out.nbytes());
      dst = scratch_.data();
    }
    MPI_Request req;
    check_mpi(MPI_Ireduce_scatter_block(in.data, dst, count(out), mpi_type(in.dtype), mpi_op(in.dtype, op), comm_, &req),
              context(what));
    wait_one(req, what);
    if (overlap) std::memcpy(out.data, scratch_.data(), out.nbytes());
  }

  void all_gather(Tensor out, Tensor in) override {
    check_host(out, "all_gather");
    check_host(in, "all_gather");
    MT_CHECK(out.dtype == in.dtype && out.numel() == in.numel() * size_, "{}: all_gather sizes {} x {} != {}", name_,
             in.numel(), size_, out.numel());
    const std::string what = fmt::format("all_gather({} x {} per rank)", in.numel(), dtype_name(in.dtype));
    const void* src = in.data;
    if (static_cast<char*>(out.data) + rank_ * in.nbytes() == in.data) {
      src = MPI_IN_PLACE;  // NCCL's in-place form
    } else {
      MT_CHECK(!overlaps(out, in), "{}: all_gather input overlaps the output other than in place", name_);
    }
    MPI_Request req;
    check_mpi(MPI_Iallgather(src, count(in), mpi_type(in.dtype), out.data, count(in), mpi_type(in.dtype), comm_, &req),
              context(what));
    wait_one(req, what);
  }

  void broadcast(Tensor t, int root) override {
    check_host(t, "broadcast");
    check_peer(root, "broadcast");
    const std::string what = fmt::format("broadcast(root {}, {} x {})", root, t.numel(), dtype_name(t.dtype));
    MPI_Request req;
    check_mpi(MPI_Ibcast(t.data, count(t), mpi_type(t.dtype), root, comm_, &req), context(what));
    wait_one(req, what);
  }

  void send(Tensor t, int peer) override {
    check_host(t, "send");
    check_peer(peer, "send");
    MPI_Request req;
    const std::string what = fmt::format("send to rank {} ({} x {})", peer, t.numel(), dtype_name(t.dtype));
    check_mpi(MPI_Isend(t.data, count(t), mpi_type(t.dtype), peer, kTag, comm_, &req), context(what));
    add_p2p(req, what);
  }

  void recv(Tensor t, int peer) override {
    check_host(t, "recv");
    check_peer(peer, "recv");
    MPI_Request req;
    const std::string what = fmt::format("recv from rank {} ({} x {})", peer, t.numel(), dtype_name(t.dtype));
    check_mpi(MPI_Irecv(t.data, count(t), mpi_type(t.dtype), peer, kTag, comm_, &req), context(what));
    add_p2p(req, what);
  }

  void group_start() override {
    MT_CHECK(!in_group_, "{}: nested group_start", name_);
    in_group_ = true;
  }

  void group_end() override {
    MT_CHECK(in_group_, "{}: group_end without group_start", name_);
    in_group_ = false;
    std::string what = "grouped point-to-point [";
    for (size_t i = 0; i < pending_what_.size(); ++i) what += (i ? ", " : "") + pending_what_[i];
    what += "]";
    std::vector<MPI_Request> reqs = std::move(pending_);
    pending_.clear();
    pending_what_.clear();
    wait_all(reqs, what);
  }

  void barrier() override {
    MPI_Request req;
    check_mpi(MPI_Ibarrier(comm_, &req), context("barrier"));
    wait_one(req, "barrier");
  }

  using Communicator::split;
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name, const GroupOptions&) override {
    // MPI_Comm_split itself cannot time out: wait for every member at a barrier first, so a rank
    // that never arrives is reported instead of hanging the split.
    const std::string what = fmt::format("split into '{}'", name);
    MPI_Request req;
    check_mpi(MPI_Ibarrier(comm_, &req), context(what));
    wait_one(req, what);
    MPI_Comm child = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &child), context(what));
    if (child == MPI_COMM_NULL) return nullptr;
    return std::make_unique<MpiCommunicator>(child, name, timeout_);
  }

  void set_timeout(Millis timeout) override { timeout_.set_after_init(timeout); }

 private:
  static constexpr int kTag = 7;

  int count(const Tensor& t) const {
    MT_CHECK(t.numel() <= INT32_MAX, "{}: {} elements exceed MPI's int count", name_, t.numel());
    return static_cast<int>(t.numel());
  }
  static bool overlaps(const Tensor& a, const Tensor& b) {
    auto* a0 = static_cast<const char*>(a.data);
    auto* b0 = static_cast<const char*>(b.data);
    return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
  }
  void check_host(const Tensor& t, const char* op) const {
    if (t.device != Device::cpu)
      fail("{}: {} on a device tensor; the MPI communicator (reference backend) moves host memory only", name_, op);
    MT_CHECK(!in_group_ || std::strcmp(op, "send") == 0 || std::strcmp(op, "recv") == 0,
             "{}: {} inside a point-to-point group", name_, op);
  }
  void check_peer(int peer, const char* op) const {
    MT_CHECK(peer >= 0 && peer < size_, "{}: {} names rank {} of a group of {}", name_, op, peer, size_);
  }
  std::string context(const std::string& what) const {
    return fmt::format("{} on group '{}' (rank {} of {}, world rank {})", what, name_, rank_, size_, g_world_rank);
  }

  void add_p2p(MPI_Request req, const std::string& what) {
    if (in_group_) {
      pending_.push_back(req);
      pending_what_.push_back(what);
      return;
    }
    std::vector<MPI_Request> one{req};
    wait_all(one, what);
  }

  void wait_one(MPI_Request& req, const std::string& what) {
    std::vector<MPI_Request> one{req};
    wait_all(one, what);
  }

  // Polls until every request completes or the deadline passes. Spins briefly (low latency for the
  // common case), then backs off to short sleeps so that oversubscribed ranks leave the cores to
  // the peers they wait for.
  void wait_all(std::vector<MPI_Request>& reqs, const std::string& what) {
    if (reqs.empty()) return;
    const auto deadline = Clock::now() + timeout_.get();
    auto nap = std::chrono::microseconds(20);
    for (int polls = 0;; ++polls) {
      int done = 0;
      check_mpi(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE), context(what));
      if (done) return;
      if (Clock::now() > deadline) {
        broken_ = true;
        fail("timed out after {} waiting for {} on group '{}' (this is rank {} of {}, world rank {}; the group "
             "is world ranks {}): some member never joined. Every rank must issue the same collectives in "
             "the same order; a slower rank may need a larger {}",
             format_duration(timeout_.get()), what, name_, rank_, size_, g_world_rank, world_ranks_, timeout_.flag());
      }
      if (polls < 200) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(nap);
        nap = std::min(nap * 2, std::chrono::microseconds(2000));
      }
    }
  }

  MPI_Comm comm_;
  std::string name_;
  SharedTimeout timeout_;
  int rank_ = 0, size_ = 1;
  std::vector<int> world_ranks_;
  bool in_group_ = false;
  bool broken_ = false;
  std::vector<MPI_Request> pending_;
  std::vector<std::string> pending_what_;
  std::vector<char> scratch_;
};

}  // namespace

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (const char* s = std::getenv(v); s && *s) return true;
  return false;
}

bool mpi_initialized() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

std::unique_ptr<Communicator> make_mpi_world_communicator(Millis timeout) {
  if (!mpi_initialized()) {
    int provided = 0;
    check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    create_16bit_ops();
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &g_world_rank);
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, "world", SharedTimeout(timeout));
}

void mpi_finalize() {
  if (!mpi_initialized()) return;
  for (auto& row : g_16bit_ops)
    for (auto& op : row)
      if (op != MPI_OP_NULL) MPI_Op_free(&op);
  MPI_Finalize();
}

void mpi_abort(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  if (mpi_initialized()) MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

}  // namespace mt
