#include "parallel/parallel_state.h"

#include <cstring>

#include "core/error.h"

namespace mt {
namespace {

// A group of one rank: reductions are identities, gathers are copies.
class SelfCommunicator final : public Communicator {
 public:
  explicit SelfCommunicator(std::string name) : name_(std::move(name)) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return name_; }
  void all_reduce(Tensor, ReduceOp) override {}
  void reduce_scatter(Tensor out, Tensor in, ReduceOp) override { copy(out, in); }
  void all_gather(Tensor out, Tensor in) override { copy(out, in); }
  void broadcast(Tensor, int) override {}
  void send(Tensor, int peer) override { fail("{}: send to rank {} in a group of one", name_, peer); }
  void recv(Tensor, int peer) override { fail("{}: recv from rank {} in a group of one", name_, peer); }
  void group_start() override {}
  void group_end() override {}
  void barrier() override {}
  using Communicator::split;
  std::unique_ptr<Communicator> split(int, int, const std::string& name, const GroupOptions&) override {
    return std::make_unique<SelfCommunicator>(name);
  }

 private:
  void copy(Tensor out, Tensor in) {
    MT_CHECK(out.nbytes() == in.nbytes(), "{}: size mismatch", name_);
    MT_CHECK(out.device == Device::cpu || out.data == in.data,
             "{}: device copies in a group of one must be done by the backend", name_);
    if (out.data != in.data) std::memmove(out.data, in.data, in.nbytes());
  }
  std::string name_;
};

}  // namespace

std::unique_ptr<Communicator> make_self_communicator(const std::string& name) {
  return std::make_unique<SelfCommunicator>(name);
}

ParallelState make_single_process_state() {
  ParallelState s;
  s.world = make_self_communicator("world");
  s.tp = make_self_communicator("tp");
  s.dp = make_self_communicator("dp");
  s.pp = make_self_communicator("pp");
  s.embedding = make_self_communicator("embedding");
  s.model_parallel = make_self_communicator("model_parallel");
  return s;
}

}  // namespace mt
