#include "client/comm/nccl/nccl_bootstrap.h"

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/rpc/coordinator_client.h"
#include "common/status_util.h"
#include "modelavg/v1/coordinator.pb.h"

namespace modelavg::client {

std::string NcclUniqueIdKey(int32_t attempt) { return absl::StrCat("nccl/", attempt); }

absl::StatusOr<std::string> ExchangeNcclUniqueId(
    const CommunicatorSetup& setup, const std::function<absl::StatusOr<std::string>()>& draw) {
  const int member = setup.MemberIndex();
  const std::string key = setup.MemberScope() + NcclUniqueIdKey(setup.bootstrap_attempt);
  if (member == 0) {
    absl::StatusOr<std::string> id = draw();
    if (!id.ok()) return id.status();
    v1::PublishCommIdRequest req;
    setup.ScopeCommIdRequest(key, &req);
    req.set_unique_id(*id);
    MODELAVG_RETURN_IF_ERROR(Annotate(
        setup.coordinator->PublishCommId(req),
        absl::StrCat("publishing the NCCL unique id (bootstrap attempt ", setup.bootstrap_attempt,
                     ")")));
    return id;
  }
  v1::GetCommIdRequest req;
  setup.ScopeCommIdRequest(key, &req);
  req.set_timeout_ms(absl::ToInt64Milliseconds(setup.timeout));
  absl::StatusOr<std::string> blob = setup.coordinator->GetCommId(req);
  if (!blob.ok()) {
    return Annotate(blob.status(), absl::StrCat("fetching the NCCL unique id (bootstrap attempt ",
                                                setup.bootstrap_attempt, ")"));
  }
  return blob;
}

}  // namespace modelavg::client
