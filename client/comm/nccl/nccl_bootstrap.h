// The NCCL communicator's bootstrap through the coordinator: the subgroup's leader draws a
// unique id and publishes it (PublishCommId), the other members fetch it (GetCommId), each
// bootstrap attempt under a key of its own.
#ifndef MODELAVG_CLIENT_COMM_NCCL_NCCL_BOOTSTRAP_H_
#define MODELAVG_CLIENT_COMM_NCCL_NCCL_BOOTSTRAP_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "client/comm/communicator.h"

namespace modelavg::client {

// The coordinator key of the NCCL unique id of bootstrap attempt `attempt` (0, 1, ...) of one
// subgroup in one generation: every attempt publishes a fresh id under its own key.
std::string NcclUniqueIdKey(int32_t attempt);

// Bootstrap step shared by every member: the subgroup's leader (member 0) draws an id with
// `draw` and publishes it under NcclUniqueIdKey(setup.bootstrap_attempt); the others fetch it
// (waiting at most setup.timeout). Returns the id's bytes.
absl::StatusOr<std::string> ExchangeNcclUniqueId(
    const CommunicatorSetup& setup, const std::function<absl::StatusOr<std::string>()>& draw);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_NCCL_NCCL_BOOTSTRAP_H_
