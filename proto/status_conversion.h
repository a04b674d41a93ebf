// absl::Status <-> grpc::Status, for the RPC layers only (server/rpc/, client/rpc/, the etcd
// client): the cores below them speak absl::Status and link no gRPC. absl and gRPC share the
// canonical code numbering; the message is kept, payloads are not (an error's kind travels in
// the RPC's own fields).
#ifndef MODELAVG_PROTO_STATUS_CONVERSION_H_
#define MODELAVG_PROTO_STATUS_CONVERSION_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace modelavg {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace modelavg

#endif  // MODELAVG_PROTO_STATUS_CONVERSION_H_
