// A communicator of simulated members on the fake device of tests/testing/fake_nccl_device.h, for
// tests that run a group's rounds with its members as threads: one FakeWorld, and per member a
// FakeOps and an initialised NcclCore (member m is rank m of n). Also the outer rule of a spec's
// level as the device outer states take it.
#ifndef MODELAVG_TESTS_TESTING_FAKE_NCCL_GROUP_H_
#define MODELAVG_TESTS_TESTING_FAKE_NCCL_GROUP_H_

#include <memory>
#include <vector>

#include "client/comm/nccl/nccl_core.h"
#include "gtest/gtest.h"
#include "modelavg/common/schedule.h"
#include "modelavg/v1/coordinator.pb.h"
#include "tests/testing/fake_nccl_device.h"

namespace modelavg::client {

struct FakeNcclGroup {
  std::unique_ptr<FakeWorld> world;
  std::vector<std::unique_ptr<FakeOps>> ops;
  std::vector<std::unique_ptr<NcclCore>> cores;

  explicit FakeNcclGroup(int n) : world(std::make_unique<FakeWorld>(n)) {
    for (int m = 0; m < n; ++m) {
      ops.push_back(std::make_unique<FakeOps>(world.get(), m));
      cores.push_back(std::make_unique<NcclCore>(ops.back().get(), m, n, 0));
      EXPECT_TRUE(cores.back()->Init().ok()) << "member " << m << " of " << n;
    }
  }
};

// Level `l`'s outer optimizer (Level.outer) as an OuterSgd.
inline OuterSgd OuterSgdOf(const v1::Level& l) {
  OuterSgd r;
  r.lr = l.outer().lr();
  r.momentum = l.outer().momentum();
  r.nesterov = l.outer().nesterov();
  return r;
}

}  // namespace modelavg::client

#endif  // MODELAVG_TESTS_TESTING_FAKE_NCCL_GROUP_H_
