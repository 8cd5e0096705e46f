// A small TCP rendezvous for host-side coordination without MPI: rank 0 listens on
// MASTER_ADDR:MASTER_PORT, every other rank connects (retrying with back-off until the deadline, so
// start-up order does not matter). Over the resulting star it offers all-gather and broadcast of
// small byte strings and a barrier: enough to hand out NCCL's 128-byte unique id, exchange
// host names and GPU ids (duplicate-GPU detection), or line the ranks up before a collective init.
//
// Every wait has the deadline given at construction; on expiry the call throws mt::Error naming the
// address, the operation and the ranks that are missing. A connection that speaks another protocol,
// another world size or a rank already taken is refused with an error (two jobs on one port fail
// loudly instead of mixing).
//
// Not thread-safe; one object per process. Rank 0's listening socket closes once all ranks joined.
#pragma once

#include <string>
#include <vector>

#include "parallel/distributed_timeout.h"

namespace mt {

class TcpRendezvous {
 public:
  // Blocks until all world_size ranks are connected (rank 0) or this rank is connected to rank 0.
  TcpRendezvous(const std::string& master_addr, int master_port, int rank, int world_size, Millis timeout);
  ~TcpRendezvous();
  TcpRendezvous(const TcpRendezvous&) = delete;
  TcpRendezvous& operator=(const TcpRendezvous&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

  // Every rank passes its blob; every rank gets all blobs, indexed by rank.
  std::vector<std::string> all_gather(const std::string& blob);
  // Rank 0's blob reaches every rank (the argument is ignored elsewhere).
  std::string broadcast(const std::string& blob);
  void barrier();

 private:
  void send_frame(int fd, const std::string& data, const char* what);
  std::string recv_frame(int fd, const char* what, int peer);

  std::string where_;  // "host:port" for messages
  int rank_ = 0, world_size_ = 1;
  Millis timeout_;
  std::vector<int> peers_;  // rank 0: socket of rank i (index i, -1 for itself); others: [0] = rank 0
};

// A TCP port on this host that was free a moment ago (bind to port 0), for the workstation launcher.
int pick_free_tcp_port();

}  // namespace mt
