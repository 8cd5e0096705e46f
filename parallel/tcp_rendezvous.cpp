#include "parallel/tcp_rendezvous.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "core/error.h"
#include "core/log.h"

namespace mt {
namespace {


using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x4d545256;  // "MTRV"
constexpr uint32_t kVersion = 1;
enum HelloStatus : uint32_t { kOk = 0, kWrongWorld = 1, kRankTaken = 2, kBadRank = 3, kBadHello = 4 };

struct Hello {
  uint32_t magic, version, world_size, rank;
};
struct HelloReply {
  uint32_t magic, status;
};

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
}

void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL, 0) | O_NONBLOCK); }

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Reads or writes exactly n bytes before the deadline. Returns "" on success, else why not.
std::string io_exact(int fd, void* buf, size_t n, bool write, Clock::time_point deadline) {
  auto* p = static_cast<char*>(buf);
  size_t done = 0;
  while (done < n) {
    const ssize_t r = write ? ::send(fd, p + done, n - done, MSG_NOSIGNAL) : ::recv(fd, p + done, n - done, 0);
    if (r > 0) {
      done += static_cast<size_t>(r);
      continue;
    }
    if (r == 0 && !write) return "connection closed by the peer";
    if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return std::strerror(errno);
    const int ms = remaining_ms(deadline);
    if (ms == 0) return "timed out";
    pollfd pfd{fd, static_cast<short>(write ? POLLOUT : POLLIN), 0};
    ::poll(&pfd, 1, ms);
  }
  return "";
}

// One connection attempt to host:port, bounded by the deadline. Returns the socket or -1 with why.
int try_connect(const std::string& host, int port, Clock::time_point deadline, std::string* why) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &res); rc != 0) {
    *why = fmt::format("cannot resolve host '{}': {}", host, gai_strerror(rc));
    return -1;
  }
  int fd = -1;
  for (addrinfo* a = res; a && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    set_nonblocking(fd);
    int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc < 0 && errno == EINPROGRESS) {
      pollfd pfd{fd, POLLOUT, 0};
      if (::poll(&pfd, 1, std::min(remaining_ms(deadline), 2000)) == 1) {
        int err = 0;
        socklen_t len = sizeof(err);
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        rc = err == 0 ? 0 : -1;
        errno = err;
      } else {
        errno = ETIMEDOUT;
      }
    }
    if (rc < 0) {
      *why = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(res);
  if (fd >= 0) set_nodelay(fd);
  return fd;
}

int listen_on(int port, std::string* why) {
  // Dual-stack IPv6 first (accepts IPv4 too), plain IPv4 where IPv6 is unavailable.
  for (int family : {AF_INET6, AF_INET}) {
    const int fd = ::socket(family, SOCK_STREAM, 0);
    if (fd < 0) continue;
    int one = 1, zero = 0;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    int rc;
    if (family == AF_INET6) {
      setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
      sockaddr_in6 addr{};
      addr.sin6_family = AF_INET6;
      addr.sin6_addr = in6addr_any;
      addr.sin6_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    } else {
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_ANY);
      addr.sin_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    }
    if (rc == 0 && ::listen(fd, 1024) == 0) {
      set_nonblocking(fd);
      return fd;
    }
    *why = std::strerror(errno);
    ::close(fd);
    if (errno == EADDRINUSE) return -1;
  }
  return -1;
}

}  // namespace

TcpRendezvous::TcpRendezvous(const std::string& master_addr, int master_port, int rank, int world_size, Millis timeout)
    : where_(fmt::format("{}:{}", master_addr, master_port)), rank_(rank), world_size_(world_size), timeout_(timeout) {
  MT_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "rendezvous rank {} of {}", rank, world_size);
  if (master_port <= 0 || master_port > 65535) fail("MASTER_PORT={} is not a TCP port (1..65535)", master_port);
  if (world_size == 1) return;
  const auto deadline = Clock::now() + timeout_;

  if (rank == 0) {
    std::string why;
    const int lfd = listen_on(master_port, &why);
    if (lfd < 0)
      fail("rank 0 cannot listen on port {} for the rendezvous: {}; another job (or a run still shutting down) "
           "may hold it: set MASTER_PORT to a free port",
           master_port, why);
    peers_.assign(world_size, -1);
    int joined = 1;
    // The wait says what it waits for every few seconds (a launch that hangs at start-up shows
    // which ranks are missing long before the timeout).
    const auto start = Clock::now();
    auto next_report = start + log::wait_progress_interval();
    while (joined < world_size) {
      const int ms = remaining_ms(deadline);
      if (ms > 0 && Clock::now() >= next_report) {
        std::vector<int> missing;
        for (int r = 1; r < world_size; ++r)
          if (peers_[r] < 0) missing.push_back(r);
        log::write_stderr(fmt::format("[rank 0] rendezvous: waiting for {} of {} ranks at {} ({:.0f} s of {}; missing "
                                      "ranks {})",
                                      world_size - joined, world_size, where_,
                                      std::chrono::duration<double>(Clock::now() - start).count(),
                                      format_duration(timeout_), missing));
        next_report += log::wait_progress_interval();
      }
      const int wait_ms = std::min<int>(ms, static_cast<int>(std::max<int64_t>(
          1, std::chrono::duration_cast<std::chrono::milliseconds>(next_report - Clock::now()).count())));
      pollfd pfd{lfd, POLLIN, 0};
      if (ms == 0 || (::poll(&pfd, 1, wait_ms) == 0 && wait_ms == ms)) {
        std::vector<int> missing;
        for (int r = 1; r < world_size; ++r)
          if (peers_[r] < 0) missing.push_back(r);
        ::close(lfd);
        fail("rendezvous at {}: only {} of {} ranks arrived within {}; missing ranks {}. Check that every rank was "
             "started with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE",
             where_, joined, world_size, format_duration(timeout_), missing);
      }
      if (!(pfd.revents & POLLIN)) continue;  // a progress report is due, or the deadline: checked above
      const int fd = ::accept(lfd, nullptr, nullptr);
      if (fd < 0) continue;
      set_nonblocking(fd);
      set_nodelay(fd);
      Hello h{};
      HelloReply reply{kMagic, kOk};
      // A client that connects but never speaks must not stall the others: bound its handshake.
      const auto hello_deadline = std::min(deadline, Clock::now() + std::chrono::seconds(5));
      if (!io_exact(fd, &h, sizeof(h), false, hello_deadline).empty() || h.magic != kMagic || h.version != kVersion) {
        reply.status = kBadHello;  // not one of ours: ignore it and keep waiting
      } else if (static_cast<int>(h.world_size) != world_size) {
        reply.status = kWrongWorld;
      } else if (h.rank < 1 || static_cast<int>(h.rank) >= world_size) {
        reply.status = kBadRank;
      } else if (peers_[h.rank] >= 0) {
        reply.status = kRankTaken;
      }
      io_exact(fd, &reply, sizeof(reply), true, hello_deadline);
      if (reply.status == kRankTaken) {
        ::close(fd);
        ::close(lfd);
        fail("rendezvous at {}: two processes claim rank {}; every rank needs a distinct RANK", where_, h.rank);
      }
      if (reply.status != kOk) {
        ::close(fd);
        continue;
      }
      peers_[h.rank] = fd;
      ++joined;
    }
    ::close(lfd);
    return;
  }

  // Other ranks: connect with back-off until rank 0 is up.
  auto nap = std::chrono::milliseconds(20);
  std::string why;
  int fd = -1;
  const auto start = Clock::now();
  auto next_report = start + log::wait_progress_interval();
  while (true) {
    fd = try_connect(master_addr, master_port, deadline, &why);
    if (fd >= 0) break;
    if (Clock::now() >= next_report && remaining_ms(deadline) > 0) {
      log::write_stderr(fmt::format("[rank {}] rendezvous: waiting for rank 0 at {} ({:.0f} s of {}; last error: {})", rank,
                                    where_, std::chrono::duration<double>(Clock::now() - start).count(),
                                    format_duration(timeout_), why));
      next_report += log::wait_progress_interval();
    }
    if (remaining_ms(deadline) == 0)
      fail("rank {} could not reach rank 0's rendezvous at {} within {} (last error: {}). Is rank 0 running, and do "
           "all ranks use the same MASTER_ADDR/MASTER_PORT?",
           rank, where_, format_duration(timeout_), why);
    std::this_thread::sleep_for(std::min<Millis>(nap, Millis(remaining_ms(deadline))));
    nap = std::min(nap * 2, Millis(1000));
  }
  Hello h{kMagic, kVersion, static_cast<uint32_t>(world_size), static_cast<uint32_t>(rank)};
  HelloReply reply{};
  std::string err = io_exact(fd, &h, sizeof(h), true, deadline);
  if (err.empty()) err = io_exact(fd, &reply, sizeof(reply), false, deadline);
  if (!err.empty() || reply.magic != kMagic) {
    ::close(fd);
    fail("rank {}: {} answered the rendezvous handshake wrongly ({}); is another program using MASTER_PORT?", rank,
         where_, err.empty() ? "not a megatrain rendezvous" : err);
  }
  if (reply.status != kOk) {
    ::close(fd);
    const char* what = reply.status == kWrongWorld ? "its world size differs from this rank's"
                       : reply.status == kRankTaken ? "another process already joined with this rank"
                                                    : "it refused this rank";
    fail("rank {} (world size {}): the rendezvous at {} refused it: {}; check RANK/WORLD_SIZE and that no other job "
         "uses MASTER_PORT",
         rank, world_size, where_, what);
  }
  peers_ = {fd};
}

TcpRendezvous::~TcpRendezvous() {
  for (int fd : peers_)
    if (fd >= 0) ::close(fd);
}

void TcpRendezvous::send_frame(int fd, const std::string& data, const char* what) {
  const auto deadline = Clock::now() + timeout_;
  uint64_t n = data.size();
  std::string err = io_exact(fd, &n, sizeof(n), true, deadline);
  if (err.empty() && n) err = io_exact(fd, const_cast<char*>(data.data()), n, true, deadline);
  if (!err.empty()) fail("rank {}: rendezvous {} at {} failed while sending: {}", rank_, what, where_, err);
}

std::string TcpRendezvous::recv_frame(int fd, const char* what, int peer) {
  const auto deadline = Clock::now() + timeout_;
  uint64_t n = 0;
  std::string err = io_exact(fd, &n, sizeof(n), false, deadline);
  std::string data;
  if (err.empty()) {
    if (n > (uint64_t{1} << 30)) fail("rank {}: rendezvous {} at {}: rank {} sent a {}-byte frame", rank_, what, where_, peer, n);
    data.resize(n);
    if (n) err = io_exact(fd, data.data(), n, false, deadline);
  }
  if (!err.empty())
    fail("rank {}: rendezvous {} at {}: waiting for rank {} failed ({}{}); did that rank exit or stall?", rank_, what,
         where_, peer, err, err == "timed out" ? fmt::format(" after {}", format_duration(timeout_)) : "");
  return data;
}

std::vector<std::string> TcpRendezvous::all_gather(const std::string& blob) {
  std::vector<std::string> all(world_size_);
  all[rank_] = blob;
  if (world_size_ == 1) return all;
  if (rank_ == 0) {
    for (int r = 1; r < world_size_; ++r) all[r] = recv_frame(peers_[r], "all_gather", r);
    std::string packed;
    for (const auto& b : all) {
      const uint64_t n = b.size();
      packed.append(reinterpret_cast<const char*>(&n), sizeof(n));
      packed += b;
    }
    for (int r = 1; r < world_size_; ++r) send_frame(peers_[r], packed, "all_gather");
    return all;
  }
  send_frame(peers_[0], blob, "all_gather");
  const std::string packed = recv_frame(peers_[0], "all_gather", 0);
  size_t pos = 0;
  for (int r = 0; r < world_size_; ++r) {
    uint64_t n = 0;
    MT_CHECK(pos + sizeof(n) <= packed.size(), "rendezvous all_gather frame truncated");
    std::memcpy(&n, packed.data() + pos, sizeof(n));
    pos += sizeof(n);
    MT_CHECK(pos + n <= packed.size(), "rendezvous all_gather frame truncated");
    all[r] = packed.substr(pos, n);
    pos += n;
  }
  return all;
}

std::string TcpRendezvous::broadcast(const std::string& blob) {
  if (world_size_ == 1) return blob;
  if (rank_ == 0) {
    for (int r = 1; r < world_size_; ++r) send_frame(peers_[r], blob, "broadcast");
    return blob;
  }
  return recv_frame(peers_[0], "broadcast", 0);
}

void TcpRendezvous::barrier() { all_gather(""); }

int pick_free_tcp_port() {
  // Probe exactly as rank 0 will listen (any address, dual-stack): a port free on the loopback
  // alone can be taken on another address (NCCL's bootstrap sockets listen on the NIC's), and
  // then rank 0's bind failed with "Address already in use".
  std::string why;
  const int fd = listen_on(0, &why);
  if (fd < 0) fail("cannot find a free TCP port: {}", why);
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  const bool ok = ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const std::string err = ok ? "" : std::strerror(errno);
  ::close(fd);
  if (!ok) fail("cannot find a free TCP port: {}", err);
  const int port = addr.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                                              : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return port;
}

}  // namespace mt
