// TCP rendezvous on loopback, ranks as threads: id exchange, late joiners, and deadlines that expire
// with errors naming what is missing.
#include <catch2/catch.hpp>

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "parallel/tcp_rendezvous.h"

using namespace mt;
using namespace std::chrono_literals;

namespace {

// Runs fn(rank) for every rank in its own thread; returns each rank's error message ("" if none).
template <typename Fn>
std::vector<std::string> run_ranks(int n, Fn fn) {
  std::vector<std::future<std::string>> futures;
  for (int r = 0; r < n; ++r)
    futures.push_back(std::async(std::launch::async, [r, &fn]() -> std::string {
      try {
        fn(r);
        return "";
      } catch (const Error& e) {
        return e.what();
      }
    }));
  std::vector<std::string> errors;
  for (auto& f : futures) errors.push_back(f.get());
  return errors;
}

}  // namespace

TEST_CASE("rendezvous hands a 128-byte id to every rank and all-gathers blobs", "[rendezvous]") {
  const int port = pick_free_tcp_port();
  const int n = 4;
  std::string id(128, '\0');
  for (int i = 0; i < 128; ++i) id[i] = static_cast<char>(i * 7 + 3);
  std::vector<std::string> got_id(n);
  std::vector<std::vector<std::string>> gathered(n);
  const auto errors = run_ranks(n, [&](int r) {
    std::this_thread::sleep_for(std::chrono::milliseconds(37 * ((r * 3) % n)));  // scrambled start order
    TcpRendezvous rv("127.0.0.1", port, r, n, 10s);
    got_id[r] = rv.broadcast(r == 0 ? id : std::string("ignored"));
    gathered[r] = rv.all_gather("host-of-rank-" + std::to_string(r) + std::string(r * 100, 'x'));
    rv.barrier();
  });
  for (int r = 0; r < n; ++r) {
    CHECK(errors[r] == "");
    CHECK(got_id[r] == id);
    REQUIRE(gathered[r].size() == static_cast<size_t>(n));
    for (int q = 0; q < n; ++q) CHECK(gathered[r][q] == "host-of-rank-" + std::to_string(q) + std::string(q * 100, 'x'));
  }
}

TEST_CASE("a rank that starts before rank 0 keeps retrying until rank 0 listens", "[rendezvous]") {
  const int port = pick_free_tcp_port();
  std::vector<std::string> got(2);
  const auto errors = run_ranks(2, [&](int r) {
    if (r == 0) std::this_thread::sleep_for(800ms);  // rank 0 is the late one
    TcpRendezvous rv("localhost", port, r, 2, 10s);
    got[r] = rv.broadcast(r == 0 ? "id" : "");
  });
  CHECK(errors == std::vector<std::string>{"", ""});
  CHECK(got == std::vector<std::string>{"id", "id"});
}

TEST_CASE("a late joiner within the deadline is waited for", "[rendezvous]") {
  const int port = pick_free_tcp_port();
  const auto errors = run_ranks(3, [&](int r) {
    if (r == 2) std::this_thread::sleep_for(700ms);
    TcpRendezvous rv("127.0.0.1", port, r, 3, 10s);
    rv.barrier();
  });
  CHECK(errors == std::vector<std::string>{"", "", ""});
}

TEST_CASE("rank 0 gives up at the deadline and names the missing ranks", "[rendezvous]") {
  const int port = pick_free_tcp_port();
  const auto t0 = std::chrono::steady_clock::now();
  const auto errors = run_ranks(2, [&](int r) {
    // World size 4, but only ranks 0 and 2 ever start.
    TcpRendezvous rv("127.0.0.1", port, r == 0 ? 0 : 2, 4, 600ms);
  });
  const auto elapsed = std::chrono::steady_clock::now() - t0;
  CHECK_THAT(errors[0], Catch::Contains("only 2 of 4 ranks arrived") && Catch::Contains("missing ranks [1, 3]"));
  CHECK(errors[1] == "");  // rank 2 connected and finished its handshake before the deadline
  CHECK(elapsed < 5s);
}

TEST_CASE("a rank with nobody listening fails at the deadline", "[rendezvous]") {
  const int port = pick_free_tcp_port();
  const auto t0 = std::chrono::steady_clock::now();
  try {
    TcpRendezvous rv("127.0.0.1", port, 1, 2, 500ms);
    FAIL("connected to nobody");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("could not reach rank 0") && Catch::Contains(std::to_string(port)));
  }
  CHECK(std::chrono::steady_clock::now() - t0 < 4s);
}

TEST_CASE("rendezvous refuses a different world size and a duplicate rank", "[rendezvous]") {
  SECTION("world size mismatch") {
    const int port = pick_free_tcp_port();
    const auto errors = run_ranks(2, [&](int r) {
      if (r == 0) TcpRendezvous rv("127.0.0.1", port, 0, 2, 1500ms);
      else TcpRendezvous rv("127.0.0.1", port, 1, 3, 1500ms);
    });
    CHECK_THAT(errors[1], Catch::Contains("world size differs"));
    CHECK_THAT(errors[0], Catch::Contains("missing ranks [1]"));
  }
  SECTION("two processes claim the same rank") {
    const int port = pick_free_tcp_port();
    const auto errors = run_ranks(3, [&](int r) {
      if (r > 0) std::this_thread::sleep_for(std::chrono::milliseconds(100 * r));
      TcpRendezvous rv("127.0.0.1", port, r == 0 ? 0 : 1, 3, 3s);
    });
    CHECK_THAT(errors[0], Catch::Contains("two processes claim rank 1"));
    CHECK_THAT(errors[2], Catch::Contains("already joined"));
  }
}

TEST_CASE("a rank that leaves makes the others' next exchange fail instead of hang", "[rendezvous]") {
  const int port = pick_free_tcp_port();
  const auto t0 = std::chrono::steady_clock::now();
  const auto errors = run_ranks(2, [&](int r) {
    TcpRendezvous rv("127.0.0.1", port, r, 2, 2s);
    if (r == 1) return;  // leaves: its socket closes
    std::this_thread::sleep_for(200ms);
    rv.all_gather("x");
  });
  CHECK_THAT(errors[0], Catch::Contains("rank 1") && Catch::Contains("did that rank exit"));
  CHECK(std::chrono::steady_clock::now() - t0 < 4s);
}
