#include "client/client.h"

#include "client/coordinator_client.h"

namespace modelavg::client {

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(ClientOptions options) {
  return absl::UnimplementedError("Client::Connect is not implemented yet");
}

Client::~Client() = default;

absl::Status Client::Leave(absl::string_view) { return absl::OkStatus(); }
absl::StatusOr<Decision> Client::DecisionAt(int64_t) {
  return absl::UnimplementedError("not implemented yet");
}
void Client::ReportStep(int64_t) {}
absl::Status Client::CheckUsable() const { return absl::OkStatus(); }
int64_t Client::latest_generation() const { return generation_; }

}  // namespace modelavg::client
