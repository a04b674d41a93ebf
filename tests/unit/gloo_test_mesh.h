// A Gloo mesh of `size` communicators over loopback, built in one process (one thread per member
// for the rendezvous through an in-memory store): for tests of GlooCommunicator alone.
#ifndef MODELAVG_TESTS_UNIT_GLOO_TEST_MESH_H_
#define MODELAVG_TESTS_UNIT_GLOO_TEST_MESH_H_

#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "client/comm/gloo/gloo_communicator.h"
#include "gloo/rendezvous/hash_store.h"

namespace modelavg::client {

// A member whose creation failed is null (the test asserts on it). `store_for` (may be empty):
// each member's view of the rendezvous store (tests/testing/gloo_link_proxy.h's DroppingStore);
// by default one shared in-memory store. `in_place` and `algorithms`: GlooCommunicator::Create's.
inline std::vector<std::unique_ptr<GlooCommunicator>> MakeGlooMesh(
    int size, absl::Duration timeout,
    const std::function<gloo::rendezvous::Store*(int member)>& store_for = nullptr,
    bool in_place = false, GlooAlgorithms algorithms = {}) {
  gloo::rendezvous::HashStore shared;
  std::vector<std::unique_ptr<GlooCommunicator>> out(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      auto dev = CreateGlooDevice("127.0.0.1");
      if (!dev.ok()) return;
      gloo::rendezvous::Store& store = store_for ? *store_for(r) : shared;
      auto comm = GlooCommunicator::Create(store, *dev, r, size, timeout, nullptr, in_place,
                                           nullptr, algorithms);
      if (comm.ok()) out[r] = *std::move(comm);
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

}  // namespace modelavg::client

#endif  // MODELAVG_TESTS_UNIT_GLOO_TEST_MESH_H_
