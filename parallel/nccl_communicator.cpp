#include "parallel/nccl_communicator.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdlib>

#include "core/error.h"
#include "parallel/launcher.h"
#include "parallel/tcp_rendezvous.h"

#if MEGATRAIN_WITH_CUDA

#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "core/log.h"

namespace mt {
namespace {

using Clock = std::chrono::steady_clock;

std::string cuda_string(cudaError_t e) { return fmt::format("{} ({})", cudaGetErrorName(e), cudaGetErrorString(e)); }

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail("CUDA error in {}: {}", what, cuda_string(e));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::u8: return ncclUint8;
    case DType::fp8_e4m3:
    case DType::fp8_e5m2: return ncclUint8;  // moved as bits (FP8 tensors are gathered, never reduced)
    case DType::i16: break;  // (master-weight remainders are never communicated)
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
  }
  return ncclSum;
}

class NcclCommunicator;

// One operation enqueued on the stream, as the watchdog sees it. Holds no strings: the message is
// formatted only when something goes wrong, so tracking allocates nothing per step.
struct Pending {
  cudaEvent_t event = nullptr;
  const NcclCommunicator* comm = nullptr;
  const char* op = "";
  int64_t count = 0;
  DType dtype = DType::f32;
  int peer = -1;
  Clock::time_point deadline;
};

// A blocking NCCL call in progress on the host (an enqueue, an initialization, a finalize). Our
// communicators are blocking: a non-blocking one launches every collective from a thread created
// for it and makes the caller poll, tens of microseconds per collective, and TP with sequence
// parallelism issues thousands of them per step. A blocking call can wait on a peer instead (a
// connection set up at first use, an enqueue stuck behind a hung kernel), so the watchdog ends the
// process when one has not returned by its deadline.
struct HostCall {
  std::atomic<Clock::rep> deadline{0};  // steady-clock ticks; 0: no call in progress
  std::atomic<const char*> op{nullptr};
  Millis timeout{0};
  std::string what;  // initialization only (set while no call is armed)

  void arm(const char* name, Millis limit) {
    op.store(name, std::memory_order_relaxed);
    timeout = limit;
    deadline.store((Clock::now() + timeout).time_since_epoch().count(), std::memory_order_release);
  }
  void disarm() { deadline.store(0, std::memory_order_release); }
  bool overdue(Clock::time_point now) const {
    const Clock::rep d = deadline.load(std::memory_order_acquire);
    return d != 0 && now.time_since_epoch().count() > d;
  }
};

// The process's NCCL watchdog (see the header).
class Watchdog {
 public:
  static Watchdog& get() {
    static Watchdog w;
    return w;
  }

  // Starts the polling thread if it is not running (before the first communicator exists, so that
  // its initialization is watched too).
  void start(int device) {
    std::lock_guard<std::mutex> lock(mu_);
    start_locked(device);
  }

  void add(NcclCommunicator* c, int device) {
    std::lock_guard<std::mutex> lock(mu_);
    comms_.push_back(c);
    start_locked(device);
  }

  // The initialization of a communicator (world or group), watched while it runs.
  HostCall& init_call() { return init_call_; }

  void remove(NcclCommunicator* c) {
    std::unique_lock<std::mutex> lock(mu_);
    std::erase(comms_, c);
    for (auto& p : ring_)
      if (p.comm == c) p.comm = nullptr;  // finished or abandoned: nothing left to report about
    if (comms_.empty() && thread_.joinable()) {
      stop_ = true;
      lock.unlock();
      thread_.join();
      lock.lock();
      for (auto& p : ring_) release(p.event);
      ring_.clear();
      head_ = 0;
    }
  }

  cudaEvent_t acquire_event() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) {
      cudaEvent_t e = free_.back();
      free_.pop_back();
      return e;
    }
    cudaEvent_t e;
    check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate (NCCL watchdog)");
    return e;
  }

  void track(const Pending& p) {
    std::lock_guard<std::mutex> lock(mu_);
    ring_.push_back(p);
  }

  [[noreturn]] void fatal(const std::string& message);

 private:
  ~Watchdog() {
    if (thread_.joinable()) {
      stop_ = true;
      thread_.join();
    }
  }
  void start_locked(int device) {
    if (thread_.joinable()) return;
    device_ = device;
    stop_ = false;
    thread_ = std::thread([this] { loop(); });
  }
  void release(cudaEvent_t e) {
    if (e) free_.push_back(e);
  }
  void loop();
  std::string describe(const Pending& p) const;

  std::mutex mu_;
  std::vector<NcclCommunicator*> comms_;
  std::vector<Pending> ring_;  // FIFO: [head_, size) pending, compacted now and then
  size_t head_ = 0;
  std::vector<cudaEvent_t> free_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  int device_ = 0;
  HostCall init_call_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, std::string name, int device, cudaStream_t stream, SharedTimeout timeout,
                   int world_rank)
      : comm_(comm), name_(std::move(name)), device_(device), stream_(stream), timeout_(std::move(timeout)),
        world_rank_(world_rank) {
    ncclCommCount(comm_, &size_);
    ncclCommUserRank(comm_, &rank_);
    check_cuda(cudaMalloc(&scratch_, 64 * sizeof(int32_t) + 64 * sizeof(int32_t) * size_), "cudaMalloc (NCCL scratch)");
    Watchdog::get().add(this, device_);
    try {
      members_ = gather_world_ranks();
    } catch (...) {
      Watchdog::get().remove(this);
      ncclCommAbort(comm_);
      cudaFree(scratch_);
      throw;
    }
  }

  ~NcclCommunicator() override {
    if (!comm_) return;
    // Let this communicator's enqueued work finish, then finalize (watched, like every blocking
    // call); abort if either fails.
    bool clean = cudaStreamSynchronize(stream_) == cudaSuccess;
    {
      std::lock_guard<std::recursive_mutex> api(api_mu_);
      if (clean && !windows_.empty()) {
        call_.arm("window deregistration", timeout());
        for (auto& [p, w] : windows_) clean = clean && ncclCommWindowDeregister(comm_, w) == ncclSuccess;
        call_.disarm();
        windows_.clear();
      }
      if (clean) {
        call_.arm("finalize", timeout());
        clean = ncclCommFinalize(comm_) == ncclSuccess;
        call_.disarm();
      }
    }
    Watchdog::get().remove(this);
    if (clean) ncclCommDestroy(comm_);
    else ncclCommAbort(comm_);
    cudaFree(scratch_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return name_; }
  const std::vector<int>& members() const { return members_; }
  int world_rank() const { return world_rank_; }
  ncclComm_t handle() const { return comm_; }
  Millis timeout() const { return timeout_.get(); }
  const char* timeout_flag() const { return timeout_.flag(); }
  void set_timeout(Millis timeout) override { timeout_.set_after_init(timeout); }
  // The blocking NCCL call now in progress on this communicator, if any (see HostCall).
  const HostCall& host_call() const { return call_; }

  void all_reduce(Tensor t, ReduceOp op) override {
    std::lock_guard<std::recursive_mutex> api(api_mu_);
    check_device(t, "all_reduce");
    call("all_reduce", [&] {
      return ncclAllReduce(t.data, t.data, t.numel(), nccl_type(t.dtype), nccl_op(op), comm_, stream_);
    });
    track("all_reduce", t.numel(), t.dtype);
  }

  void reduce_scatter(Tensor out, Tensor in, ReduceOp op) override {
    std::lock_guard<std::recursive_mutex> api(api_mu_);
    check_device(out, "reduce_scatter");
    check_device(in, "reduce_scatter");
    MT_CHECK(out.dtype == in.dtype && in.numel() == out.numel() * size_, "{}: reduce_scatter sizes {} x {} != {}",
             name_, out.numel(), size_, in.numel());
    call("reduce_scatter", [&] {
      return ncclReduceScatter(in.data, out.data, out.numel(), nccl_type(in.dtype), nccl_op(op), comm_, stream_);
    });
    track("reduce_scatter", out.numel(), out.dtype);
  }

  void all_gather(Tensor out, Tensor in) override {
    std::lock_guard<std::recursive_mutex> api(api_mu_);
    check_device(out, "all_gather");
    check_device(in, "all_gather");
    MT_CHECK(out.dtype == in.dtype && out.numel() == in.numel() * size_, "{}: all_gather sizes {} x {} != {}", name_,
             in.numel(), size_, out.numel());
    call("all_gather", [&] { return ncclAllGather(in.data, out.data, in.numel(), nccl_type(in.dtype), comm_, stream_); });
    track("all_gather", in.numel(), in.dtype);
  }

  void broadcast(Tensor t, int root) override {
    std::lock_guard<std::recursive_mutex> api(api_mu_);
    check_device(t, "broadcast");
    MT_CHECK(root >= 0 && root < size_, "{}: broadcast root {} of {}", name_, root, size_);
    call("broadcast", [&] {
      return ncclBroadcast(t.data, t.data, t.numel(), nccl_type(t.dtype), root, comm_, stream_);
    });
    track("broadcast", t.numel(), t.dtype, root);
  }

  void send(Tensor t, int peer) override {
    std::lock_guard<std::recursive_mutex> api(api_mu_);
    check_device(t, "send");
    MT_CHECK(peer >= 0 && peer < size_ && peer != rank_, "{}: send to rank {} of {}", name_, peer, size_);
    call("send", [&] { return ncclSend(t.data, t.numel(), nccl_type(t.dtype), peer, comm_, stream_); });
    if (in_group_) {
      group_bytes_ += t.nbytes();
      last_peer_ = peer;
    } else {
      track("send", t.numel(), t.dtype, peer);
    }
  }

  void recv(Tensor t, int peer) override {
    std::lock_guard<std::recursive_mutex> api(api_mu_);
    check_device(t, "recv");
    MT_CHECK(peer >= 0 && peer < size_ && peer != rank_, "{}: recv from rank {} of {}", name_, peer, size_);
    call("recv", [&] { return ncclRecv(t.data, t.numel(), nccl_type(t.dtype), peer, comm_, stream_); });
    if (in_group_) {
      group_bytes_ += t.nbytes();
      last_peer_ = peer;
    } else {
      track("recv", t.numel(), t.dtype, peer);
    }
  }

  void group_start() override {
    MT_CHECK(!in_group_, "{}: nested group_start", name_);
    in_group_ = true;
    group_bytes_ = 0;
    last_peer_ = -1;
    call("group_start", [] { return ncclGroupStart(); });
  }

  void group_end() override {
    std::lock_guard<std::recursive_mutex> api(api_mu_);
    MT_CHECK(in_group_, "{}: group_end without group_start", name_);
    in_group_ = false;
    call("grouped send/recv", [] { return ncclGroupEnd(); });
    track("grouped send/recv", static_cast<int64_t>(group_bytes_), DType::u8, last_peer_);
  }

  void barrier() override {
    // NCCL has no barrier: an all-reduce of one value, then the host waits for it.
    Tensor one(scratch_, DType::f32, Device::cuda, {1});
    all_reduce(one, ReduceOp::sum);
    wait_stream("barrier");
  }

  // Splits by handing out one fresh ncclUniqueId per color over this communicator and initialising
  // each group with ncclCommInitRankConfig, instead of ncclCommSplit: on the H200 machines (NCCL
  // 2.28.3) ncclCommSplit returned success and no child handle, in blocking and non-blocking mode.
  using Communicator::split;
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name,
                                      const GroupOptions& options) override {
    const int32_t mine[2] = {color < 0 ? -1 : color, key};
    const std::vector<char> pairs = all_gather_host(mine, sizeof(mine));
    auto at = [&](int r, int i) {
      int32_t v;
      std::memcpy(&v, pairs.data() + (static_cast<size_t>(r) * 2 + i) * sizeof(int32_t), sizeof(v));
      return v;
    };
    // Members of my color, ordered by (key, rank); the first one creates the group's id.
    std::vector<int> members;
    for (int r = 0; r < size_; ++r)
      if (color >= 0 && at(r, 0) == color) members.push_back(r);
    std::sort(members.begin(), members.end(),
              [&](int x, int y) { return std::make_pair(at(x, 1), x) < std::make_pair(at(y, 1), y); });
    bool leader = false;
    for (int r = 0; r < size_; ++r) {
      if (at(r, 0) < 0) continue;
      bool first = true;  // r is its color's leader if no member of the color sorts before it
      for (int q = 0; q < size_; ++q)
        if (q != r && at(q, 0) == at(r, 0) && std::make_pair(at(q, 1), q) < std::make_pair(at(r, 1), r)) first = false;
      if (first && r == rank_) leader = true;
    }
    ncclUniqueId id{};
    if (leader) {
      const ncclResult_t r = ncclGetUniqueId(&id);
      if (r != ncclSuccess) fail("ncclGetUniqueId for group '{}' failed: {}", name, ncclGetErrorString(r));
    }
    const std::vector<char> ids = all_gather_host(&id, sizeof(id));
    if (color < 0) return nullptr;
    std::memcpy(&id, ids.data() + static_cast<size_t>(members.front()) * sizeof(id), sizeof(id));
    const int my_index = static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());

    const std::string what = fmt::format("creation of group '{}' (rank {} of {}) from '{}'", name, my_index,
                                         members.size(), name_);
    ncclComm_t child = init_communicator(what, name.c_str(), static_cast<int>(members.size()), id, my_index, device_,
                                         timeout(), options.ctas);
    return std::make_unique<NcclCommunicator>(child, name, device_, stream_, timeout_, world_rank_);
  }

  void* allocate_symmetric(size_t bytes) override {
    void* p = nullptr;
    const ncclResult_t r = ncclMemAlloc(&p, bytes);
    if (r != ncclSuccess) {
      log::warn("ncclMemAlloc of {:.1f} MiB failed ({}): group '{}' moves its all-gathers with kernels",
                bytes / 1048576.0, ncclGetErrorString(r), name_);
      return nullptr;
    }
    return p;
  }
  void free_symmetric(void* p) override {
    if (p) ncclMemFree(p);
  }
  bool register_symmetric(void* p, size_t bytes) override {
    std::lock_guard<std::recursive_mutex> api(api_mu_);
    ncclWindow_t w = nullptr;
    call_.arm("window registration", timeout());
    const ncclResult_t r = ncclCommWindowRegister(comm_, p, bytes, &w, NCCL_WIN_COLL_SYMMETRIC);
    call_.disarm();
    if (r != ncclSuccess || !w) {
      log::warn("NCCL window registration on group '{}' failed ({}): its all-gathers use kernels", name_,
                ncclGetErrorString(r));
      return false;
    }
    windows_.emplace_back(p, w);
    return true;
  }
  void deregister_symmetric(void* p) override {
    std::lock_guard<std::recursive_mutex> api(api_mu_);
    for (auto it = windows_.begin(); it != windows_.end(); ++it) {
      if (it->first != p) continue;
      call("window deregistration", [&] { return ncclCommWindowDeregister(comm_, it->second); });
      windows_.erase(it);
      return;
    }
  }

  void set_stream(void* stream) override {
    MT_CHECK(!in_group_, "{}: set_stream inside a point-to-point group", name_);
    stream_ = static_cast<cudaStream_t>(stream);
  }

  // Creates one (blocking) communicator, watched: past the timeout the watchdog ends the process
  // with `what` in its message.
  static ncclComm_t init_communicator(const std::string& what, const char* name, int nranks, const ncclUniqueId& id,
                                      int rank, int device, Millis timeout, int ctas = 0) {
    Watchdog& w = Watchdog::get();
    w.start(device);
    HostCall& guard = w.init_call();
    guard.what = what;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 1;
    config.commName = name;
    // All-gathers within registered symmetric memory go to the copy engines (register_symmetric);
    // nothing else changes.
    config.CTAPolicy = NCCL_CTA_POLICY_ZERO;
    if (ctas > 0) config.minCTAs = config.maxCTAs = ctas;
    ncclComm_t comm = nullptr;
    guard.arm("initialization", timeout);
    const ncclResult_t r = ncclCommInitRankConfig(&comm, nranks, id, rank, &config);
    guard.disarm();
    if (r != ncclSuccess) {
      if (comm) ncclCommAbort(comm);
      fail("NCCL {} failed: {} ({})", what, ncclGetErrorString(r), comm ? ncclGetLastError(comm) : "");
    }
    if (!comm) fail("NCCL {} returned no communicator", what);
    return comm;
  }

 private:
  void check_device(const Tensor& t, const char* op) const {
    if (t.device != Device::cuda)
      fail("{}: {} on a host tensor; the NCCL communicator moves device memory (use the MPI communicator for "
           "--device cpu)",
           name_, op);
  }

  // One blocking NCCL call, with the watchdog's deadline armed around it.
  template <class F>
  void call(const char* what, F&& nccl) {
    call_.arm(what, timeout());
    const ncclResult_t r = nccl();
    call_.disarm();
    if (r == ncclSuccess) return;
    fail("NCCL {} on group '{}' (rank {} of {}) failed: {} ({})", what, name_, rank_, size_, ncclGetErrorString(r),
         ncclGetLastError(comm_));
  }

  void track(const char* op, int64_t count, DType dtype, int peer = -1) {
    Watchdog& w = Watchdog::get();
    Pending p;
    p.event = w.acquire_event();
    p.comm = this;
    p.op = op;
    p.count = count;
    p.dtype = dtype;
    p.peer = peer;
    p.deadline = Clock::now() + timeout();
    check_cuda(cudaEventRecord(p.event, stream_), "cudaEventRecord (NCCL watchdog)");
    w.track(p);
  }

  void wait_stream(const char* what) {
    const auto deadline = Clock::now() + timeout() + std::chrono::seconds(5);
    while (true) {
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) fail("CUDA error while waiting for {} on group '{}': {}", what, name_, cuda_string(e));
      // The watchdog ends the process first when the collective times out; this is a backstop.
      if (Clock::now() > deadline)
        Watchdog::get().fatal(fmt::format("{} on group '{}' did not finish within {}", what, name_,
                                          format_duration(timeout())));
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  // The world rank of every member, in group-rank order (for error messages).
  // All-gather of a small host blob (set-up time only: allocates a temporary device buffer).
  std::vector<char> all_gather_host(const void* data, size_t bytes) {
    std::lock_guard<std::recursive_mutex> api(api_mu_);
    const size_t padded = (bytes + 3) / 4 * 4;
    void* dev = nullptr;
    check_cuda(cudaMalloc(&dev, padded * (size_ + 1)), "cudaMalloc (host all-gather)");
    std::vector<char> out(padded * size_);
    try {
      std::vector<char> in(padded, 0);
      std::memcpy(in.data(), data, bytes);
      check_cuda(cudaMemcpyAsync(dev, in.data(), padded, cudaMemcpyHostToDevice, stream_), "cudaMemcpy");
      const int64_t words = static_cast<int64_t>(padded / 4);
      all_gather(Tensor(static_cast<char*>(dev) + padded, DType::i32, Device::cuda, {words * size_}),
                 Tensor(dev, DType::i32, Device::cuda, {words}));
      check_cuda(cudaMemcpyAsync(out.data(), static_cast<char*>(dev) + padded, out.size(), cudaMemcpyDeviceToHost,
                                 stream_),
                 "cudaMemcpy");
      wait_stream("host all-gather");
    } catch (...) {
      cudaFree(dev);
      throw;
    }
    cudaFree(dev);
    std::vector<char> result(bytes * size_);
    for (int r = 0; r < size_; ++r) std::memcpy(result.data() + r * bytes, out.data() + r * padded, bytes);
    return result;
  }

  std::vector<int> gather_world_ranks() {
    std::lock_guard<std::recursive_mutex> api(api_mu_);
    auto* dev = static_cast<int32_t*>(scratch_);
    check_cuda(cudaMemcpyAsync(dev, &world_rank_, sizeof(int32_t), cudaMemcpyHostToDevice, stream_), "cudaMemcpy");
    all_gather(Tensor(dev + 64, DType::i32, Device::cuda, {size_}), Tensor(dev, DType::i32, Device::cuda, {1}));
    std::vector<int> out(size_);
    check_cuda(cudaMemcpyAsync(out.data(), dev + 64, sizeof(int32_t) * size_, cudaMemcpyDeviceToHost, stream_),
               "cudaMemcpy");
    wait_stream("member exchange");
    return out;
  }

  ncclComm_t comm_ = nullptr;
  std::string name_;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  std::recursive_mutex api_mu_;
  SharedTimeout timeout_;
  int world_rank_ = 0;
  int rank_ = 0, size_ = 1;
  std::vector<int> members_;
  void* scratch_ = nullptr;
  HostCall call_;
  std::vector<std::pair<void*, ncclWindow_t>> windows_;  // register_symmetric
  bool in_group_ = false;
  size_t group_bytes_ = 0;
  int last_peer_ = -1;
};

std::string Watchdog::describe(const Pending& p) const {
  const NcclCommunicator* c = p.comm;
  if (!c) return fmt::format("NCCL {} on a communicator already closed", p.op);
  std::string peer;
  if (p.peer >= 0 && p.peer < static_cast<int>(c->members().size()))
    peer = fmt::format(", peer rank {} = world rank {}", p.peer, c->members()[p.peer]);
  const std::string size = std::string(p.op) == "grouped send/recv"
                               ? fmt::format("{} bytes", p.count)
                               : fmt::format("{} x {}", p.count, dtype_name(p.dtype));
  return fmt::format("NCCL {} ({}{}) on group '{}' (rank {} of {}; the group is world ranks {})", p.op, size, peer,
                     c->name(), c->rank(), c->size(), c->members());
}

void Watchdog::fatal(const std::string& message) {
  // Print first (aborting can take a moment), then abort every communicator, then leave without
  // running destructors (they would wait on the hung stream).
  log::error(message + ". Aborting all NCCL communicators and exiting.");
  std::vector<NcclCommunicator*> comms;
  {
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    comms = comms_;
  }
  // Aborting a communicator whose owner is stuck inside a blocking NCCL call may wait on that call;
  // the process leaves after 10 s whether or not every abort returned.
  std::atomic<bool> aborted{false};
  std::thread([&comms, &aborted] {
    for (NcclCommunicator* c : comms) ncclCommAbort(c->handle());
    aborted = true;
  }).detach();
  for (int i = 0; i < 1000 && !aborted; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(1);
}

void Watchdog::loop() {
  cudaSetDevice(device_);
  const Millis poll = nccl_watchdog_poll_interval();
  while (!stop_) {
    std::string problem;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // A blocking NCCL call that has not returned in time.
      const auto now = Clock::now();
      if (init_call_.overdue(now))
        problem = fmt::format("NCCL {} did not finish within {}: a rank may be missing or unreachable "
                              "(NCCL_DEBUG=INFO shows where it stops; NCCL_SOCKET_IFNAME selects the network "
                              "interface)",
                              init_call_.what, format_duration(init_call_.timeout));
      for (NcclCommunicator* c : comms_) {
        if (!problem.empty() || !c->host_call().overdue(now)) continue;
        problem = fmt::format("NCCL {} on group '{}' (rank {} of {}; the group is world ranks {}) did not return "
                              "within {}: a peer rank may have died, or be stuck before this operation (look for its "
                              "error); {} sets the limit",
                              c->host_call().op.load(), c->name(), c->rank(), c->size(), c->members(),
                              format_duration(c->host_call().timeout), c->timeout_flag());
      }
      // Asynchronous errors (a peer died, a network failure).
      for (NcclCommunicator* c : comms_) {
        if (!problem.empty()) break;
        // Safe beside the owner's calls for a blocking communicator (PyTorch's watchdog does the
        // same). (With non-blocking communicators it was not: ncclCommGetAsyncError reaps a pending
        // group job, and two threads reaping one job made NCCL report "internal error ... job
        // error 3"; one more reason they are blocking now.)
        ncclResult_t st = ncclSuccess;
        if (ncclCommGetAsyncError(c->handle(), &st) == ncclSuccess && st != ncclSuccess && st != ncclInProgress) {
          problem = fmt::format("NCCL reported an asynchronous error on group '{}' (rank {} of {}; world ranks {}): "
                                "{} ({})",
                                c->name(), c->rank(), c->size(), c->members(), ncclGetErrorString(st),
                                ncclGetLastError(c->handle()));
          break;
        }
      }
      // Completed operations leave the front of the queue; the oldest unfinished one has a deadline.
      while (problem.empty() && head_ < ring_.size()) {
        Pending& p = ring_[head_];
        const cudaError_t e = cudaEventQuery(p.event);
        if (e == cudaSuccess) {
          release(p.event);
          ++head_;
          continue;
        }
        if (e != cudaErrorNotReady) {
          problem = fmt::format("CUDA error {} while waiting for {}", cuda_string(e), describe(p));
        } else if (Clock::now() > p.deadline) {
          problem = fmt::format("{} did not finish within {}: a peer rank may have died, or be stuck before this "
                                "operation (look for its error); {} sets the limit",
                                describe(p), format_duration(p.comm ? p.comm->timeout() : Millis(0)),
                                p.comm ? p.comm->timeout_flag() : "--distributed-timeout-minutes");
        }
        break;
      }
      if (head_ > 1024 && head_ * 2 > ring_.size()) {
        ring_.erase(ring_.begin(), ring_.begin() + static_cast<std::ptrdiff_t>(head_));
        head_ = 0;
      }
    }
    if (!problem.empty()) fatal(problem);
    std::this_thread::sleep_for(poll);
  }
}

std::string gpu_identity(int device) {
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  std::string uuid;
  for (unsigned char b : prop.uuid.bytes) uuid += fmt::format("{:02x}", b);
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return fmt::format("{}|{}|{}|{}", host, uuid, device, prop.name);
}

}  // namespace

bool nccl_available() { return true; }

std::unique_ptr<Communicator> make_nccl_world_communicator(TcpRendezvous& rv, int device, CUstream_st* stream,
                                                           Millis timeout) {
  disable_nvlink_multicast_unless_set();
  check_cuda(cudaSetDevice(device), fmt::format("cudaSetDevice({})", device).c_str());

  // Two ranks on one GPU: NCCL would fail later with a less helpful message (or hang in the
  // topology search); say which ranks collide.
  const std::vector<std::string> ids = rv.all_gather(gpu_identity(device));
  std::map<std::string, int> first_user;  // "host|uuid" -> first rank using it
  for (int r = 0; r < static_cast<int>(ids.size()); ++r) {
    const size_t host_end = ids[r].find('|');
    const size_t uuid_end = ids[r].find('|', host_end + 1);
    MT_CHECK(host_end != std::string::npos && uuid_end != std::string::npos, "GPU identity '{}'", ids[r]);
    auto [it, fresh] = first_user.emplace(ids[r].substr(0, uuid_end), r);
    if (!fresh)
      fail("ranks {} and {} both use GPU {} (UUID {}) on host {}: each rank needs its own GPU (check "
           "CUDA_VISIBLE_DEVICES, LOCAL_RANK and --nproc-per-node)",
           it->second, r, ids[r].substr(uuid_end + 1), ids[r].substr(host_end + 1, uuid_end - host_end - 1),
           ids[r].substr(0, host_end));
  }

  ncclUniqueId id;
  std::string blob;
  if (rv.rank() == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) fail("ncclGetUniqueId failed: {}", ncclGetErrorString(r));
    blob.assign(reinterpret_cast<const char*>(&id), sizeof(id));
  }
  blob = rv.broadcast(blob);
  MT_CHECK(blob.size() == sizeof(id), "NCCL unique id of {} bytes", blob.size());
  std::memcpy(&id, blob.data(), sizeof(id));

  ncclComm_t comm = NcclCommunicator::init_communicator(
      fmt::format("initialization of the world communicator (rank {} of {})", rv.rank(), rv.world_size()), "world",
      rv.world_size(), id, rv.rank(), device, timeout);
  return std::make_unique<NcclCommunicator>(comm, "world", device, reinterpret_cast<cudaStream_t>(stream),
                                            SharedTimeout(timeout), rv.rank());
}

}  // namespace mt

#else  // !MEGATRAIN_WITH_CUDA

namespace mt {

bool nccl_available() { return false; }

std::unique_ptr<Communicator> make_nccl_world_communicator(TcpRendezvous&, int, CUstream_st*, Millis) {
  fail("this megatrain was built without CUDA/NCCL: GPU runs with several ranks need a CUDA build "
       "(use --device cpu under mpirun for the reference backend)");
}

}  // namespace mt

#endif

namespace mt {

Millis nccl_watchdog_poll_interval() {
  if (const char* s = std::getenv("MEGATRAIN_NCCL_WATCHDOG_POLL_MS"); s && *s) {
    const long ms = std::strtol(s, nullptr, 10);
    if (ms > 0) return Millis(ms);
  }
  return Millis(100);
}

}  // namespace mt
