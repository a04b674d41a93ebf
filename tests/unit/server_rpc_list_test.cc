// The RPC list (server/rpc/coordinator_rpcs.h) against the API: every method of the service has
// exactly one line, with the proto's request and response, and the roles are the documented ones.
#include <map>
#include <set>
#include <string>

#include "google/protobuf/descriptor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "modelavg/v1/coordinator.pb.h"
#include "server/rpc/coordinator_rpcs.h"
#include "server/rpc/rpc_metrics.h"
#include "server/rpc/service_auth.h"

namespace modelavg::server {
namespace {

const google::protobuf::ServiceDescriptor& Service() {
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          "modelavg.v1.Coordinator");
  EXPECT_NE(service, nullptr);
  return *service;
}

TEST(RpcListTest, EveryMethodOfTheServiceHasOneLine) {
  std::set<std::string> listed;
  for (int i = 0; i < static_cast<int>(RpcMethod::kCount); ++i) {
    EXPECT_TRUE(listed.insert(RpcMethodName(static_cast<RpcMethod>(i))).second)
        << RpcMethodName(static_cast<RpcMethod>(i)) << " has two lines";
  }
  std::set<std::string> in_proto;
  for (int i = 0; i < Service().method_count(); ++i) in_proto.insert(Service().method(i)->name());
  EXPECT_EQ(listed, in_proto);
}

TEST(RpcListTest, EachLineHasTheProtosMessages) {
  int lines = 0;
#define MODELAVG_CHECK_MESSAGES(name, Request, Response, ...)                                 \
  {                                                                                          \
    ++lines;                                                                                 \
    const google::protobuf::MethodDescriptor* method = Service().FindMethodByName(#name);    \
    ASSERT_NE(method, nullptr) << #name;                                                     \
    EXPECT_EQ(method->input_type(), Request::descriptor()) << #name;                         \
    EXPECT_EQ(method->output_type(), Response::descriptor()) << #name;                       \
  }
  MODELAVG_COORDINATOR_RPCS(MODELAVG_CHECK_MESSAGES)
#undef MODELAVG_CHECK_MESSAGES
  EXPECT_EQ(lines, static_cast<int>(RpcMethod::kCount));
}

TEST(RpcListTest, OnlyCreateDeleteAndUpdateJobNeedTheOperatorRole) {
  std::map<std::string, Role> roles;
#define MODELAVG_ROLE(name, Request, Response, need, ...) roles[#name] = need;
  MODELAVG_COORDINATOR_RPCS(MODELAVG_ROLE)
#undef MODELAVG_ROLE
  std::set<std::string> operator_only;
  for (const auto& [name, role] : roles) {
    EXPECT_NE(role, Role::kNone) << name;
    if (role == Role::kOperator) operator_only.insert(name);
  }
  EXPECT_EQ(operator_only, (std::set<std::string>{"CreateJob", "DeleteJob", "UpdateJob"}));
}

}  // namespace
}  // namespace modelavg::server
