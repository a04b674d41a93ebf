// modelavg-rpc: calls a gRPC server the way grpcurl does, knowing only what the server's
// reflection service tells it (no .proto files). Shipped in the container image so that a
// person, or a test, can inspect a running coordinator from inside the compose network.
//
//   modelavg-rpc --coordinator=coordinator:50051 list
//   modelavg-rpc --coordinator=coordinator:50051 describe modelavg.v1.Coordinator
//   modelavg-rpc --coordinator=coordinator:50051 call modelavg.v1.Coordinator/GetSchedule \
//       '{"job_id": "demo", "from_step": 0, "count": 24}'
//
// The connection flags are every modelavg program's (client/flags/connection_flags.h; the old
// --address, --token_file and --timeout_ms still work): --coordinator (default
// $MODELAVG_COORDINATOR, else 127.0.0.1:50051), --auth_token_file (sends "authorization: Bearer
// <token>"), --tls, --tls_ca_file, --tls_cert_file/--tls_key_file, --rpc_timeout_ms (here the
// deadline of the whole command).
// Unary methods only. Exit status 0 on success; 1 with one line on stderr saying what failed
// (unreachable server, unknown service or method, bad JSON, the call's gRPC error); 2 on usage.
#include <chrono>
#include <condition_variable>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "client/flags/connection_flags.h"
#include "client/rpc/connection.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/descriptor_database.h"
#include "google/protobuf/dynamic_message.h"
#include "google/protobuf/util/json_util.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

namespace {

namespace pb = google::protobuf;
namespace refl = grpc::reflection::v1alpha;

constexpr char kUsage[] =
    "Calls a gRPC server through its reflection service.\n"
    "  modelavg-rpc [--coordinator=HOST:PORT] list\n"
    "  modelavg-rpc [--coordinator=HOST:PORT] describe SERVICE|MESSAGE\n"
    "  modelavg-rpc [--coordinator=HOST:PORT] call SERVICE/METHOD [JSON]";

class Failure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

std::string StatusText(const grpc::Status& status) {
  return absl::StrCat("code ", static_cast<int>(status.error_code()), ": ",
                      status.error_message());
}

class Client {
 public:
  explicit Client(const modelavg::client::ConnectionOptions& conn) {
    absl::StatusOr<modelavg::client::CoordinatorChannel> c = modelavg::client::OpenChannel(conn);
    if (!c.ok()) throw Failure(std::string(c.status().message()));
    token_ = c->token;
    channel_ = c->channel;
    address_ = conn.coordinator;
    deadline_ = std::chrono::system_clock::now() + absl::ToChronoMilliseconds(conn.rpc_timeout);
  }

  void Prepare(grpc::ClientContext* context) const {
    context->set_deadline(deadline_);
    if (!token_.empty()) context->AddMetadata("authorization", absl::StrCat("Bearer ", token_));
  }

  // The services the server lists through reflection.
  std::vector<std::string> ListServices() {
    refl::ServerReflectionRequest request;
    request.set_list_services("");
    const refl::ServerReflectionResponse response = Ask(request);
    std::vector<std::string> names;
    for (const auto& service : response.list_services_response().service()) {
      names.push_back(service.name());
    }
    return names;
  }

  // Loads into the pool the file that defines `symbol` and every file it imports.
  void LoadSymbol(const std::string& symbol) {
    refl::ServerReflectionRequest request;
    request.set_file_containing_symbol(symbol);
    AddFiles(Ask(request));
    // Imports the server did not send along: ask for them by name until none is missing.
    for (bool added = true; added;) {
      added = false;
      std::set<std::string> missing;
      for (const auto& [name, file] : files_) {
        for (const auto& dep : file.dependency()) {
          if (!files_.count(dep)) missing.insert(dep);
        }
      }
      for (const auto& dep : missing) {
        refl::ServerReflectionRequest by_name;
        by_name.set_file_by_filename(dep);
        AddFiles(Ask(by_name));
        added = true;
      }
    }
    pool_.reset();
  }

  const pb::DescriptorPool& Pool() {
    if (!pool_) {
      database_ = std::make_unique<pb::SimpleDescriptorDatabase>();
      for (const auto& [name, file] : files_) database_->Add(file);
      pool_ = std::make_unique<pb::DescriptorPool>(database_.get());
    }
    return *pool_;
  }

  // One unary call with serialized request and response.
  std::string Call(const std::string& method_path, const std::string& request) {
    grpc::GenericStub stub(channel_);
    grpc::ClientContext context;
    Prepare(&context);
    grpc::Slice slice(request);
    grpc::ByteBuffer request_buffer(&slice, 1);
    grpc::ByteBuffer response_buffer;
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    grpc::Status status;
    stub.UnaryCall(&context, method_path, grpc::StubOptions(), &request_buffer, &response_buffer,
                   [&](grpc::Status s) {
                     std::lock_guard<std::mutex> lock(mu);
                     status = std::move(s);
                     done = true;
                     cv.notify_one();
                   });
    {
      // The call ends by the context's deadline at the latest.
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return done; });
    }
    if (!status.ok()) throw Failure(absl::StrCat(method_path, ": ", StatusText(status)));
    std::vector<grpc::Slice> slices;
    grpc::Status dump = response_buffer.Dump(&slices);
    if (!dump.ok()) throw Failure(absl::StrCat(method_path, ": unreadable response"));
    std::string out;
    for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
    return out;
  }

 private:
  refl::ServerReflectionResponse Ask(const refl::ServerReflectionRequest& request) {
    auto stub = refl::ServerReflection::NewStub(channel_);
    grpc::ClientContext context;
    Prepare(&context);
    auto stream = stub->ServerReflectionInfo(&context);
    refl::ServerReflectionResponse response;
    const bool sent = stream->Write(request) && stream->WritesDone();
    const bool read = sent && stream->Read(&response);
    grpc::Status status = stream->Finish();
    if (!status.ok()) {
      throw Failure(absl::StrCat(address_, ": reflection failed: ", StatusText(status)));
    }
    if (!read) throw Failure(absl::StrCat(address_, ": reflection sent no answer"));
    if (response.has_error_response()) {
      throw Failure(absl::StrCat(address_, ": reflection: ",
                                 response.error_response().error_message()));
    }
    return response;
  }

  void AddFiles(const refl::ServerReflectionResponse& response) {
    for (const auto& bytes : response.file_descriptor_response().file_descriptor_proto()) {
      pb::FileDescriptorProto file;
      if (!file.ParseFromString(bytes)) {
        throw Failure(absl::StrCat(address_, ": reflection sent an unparsable descriptor"));
      }
      files_.emplace(file.name(), file);
    }
  }

  std::string address_;
  std::string token_;
  std::chrono::system_clock::time_point deadline_;
  std::shared_ptr<grpc::Channel> channel_;
  std::map<std::string, pb::FileDescriptorProto> files_;
  std::unique_ptr<pb::SimpleDescriptorDatabase> database_;
  std::unique_ptr<pb::DescriptorPool> pool_;
};

int List(Client& client) {
  for (const auto& name : client.ListServices()) std::cout << name << "\n";
  return 0;
}

int Describe(Client& client, const std::string& symbol) {
  client.LoadSymbol(symbol);
  const pb::DescriptorPool& pool = client.Pool();
  if (const auto* service = pool.FindServiceByName(symbol)) {
    std::cout << service->DebugString();
  } else if (const auto* message = pool.FindMessageTypeByName(symbol)) {
    std::cout << message->DebugString();
  } else {
    throw Failure(absl::StrCat(symbol, " is neither a service nor a message"));
  }
  return 0;
}

int Call(Client& client, const std::string& path, const std::string& json) {
  std::vector<std::string> parts = absl::StrSplit(path, '/');
  if (parts.size() != 2 || parts[0].empty() || parts[1].empty()) {
    throw Failure(absl::StrCat("'", path, "': expected SERVICE/METHOD, e.g. "
                               "modelavg.v1.Coordinator/ListJobs"));
  }
  client.LoadSymbol(parts[0]);
  const pb::DescriptorPool& pool = client.Pool();
  const pb::ServiceDescriptor* service = pool.FindServiceByName(parts[0]);
  if (service == nullptr) throw Failure(absl::StrCat("no service ", parts[0]));
  const pb::MethodDescriptor* method = service->FindMethodByName(parts[1]);
  if (method == nullptr) {
    throw Failure(absl::StrCat(parts[0], " has no method ", parts[1]));
  }
  if (method->client_streaming() || method->server_streaming()) {
    throw Failure(absl::StrCat(path, " is a streaming method; only unary methods are supported"));
  }
  pb::DynamicMessageFactory factory(&pool);
  std::unique_ptr<pb::Message> request(factory.GetPrototype(method->input_type())->New());
  auto parsed = pb::util::JsonStringToMessage(json, request.get());
  if (!parsed.ok()) {
    throw Failure(absl::StrCat("the request is not a valid ", method->input_type()->full_name(),
                               " in JSON: ", parsed.ToString()));
  }
  const std::string bytes =
      client.Call(absl::StrCat("/", service->full_name(), "/", method->name()),
                  request->SerializeAsString());
  std::unique_ptr<pb::Message> response(factory.GetPrototype(method->output_type())->New());
  if (!response->ParseFromString(bytes)) {
    throw Failure(absl::StrCat(path, ": the response is not a ",
                               method->output_type()->full_name()));
  }
  pb::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  std::string out;
  auto printed = pb::util::MessageToJsonString(*response, &out, options);
  if (!printed.ok()) throw Failure(absl::StrCat(path, ": ", printed.ToString()));
  std::cout << out;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  auto usage = [] {
    std::cerr << kUsage << std::endl;
    return 2;
  };
  if (args.size() < 2) return usage();
  modelavg::client::ConnectionOptions defaults;
  defaults.coordinator = "127.0.0.1:50051";
  absl::StatusOr<modelavg::client::ConnectionOptions> conn =
      modelavg::client::ConnectionFromFlags(defaults);
  if (!conn.ok()) {
    std::cerr << "modelavg-rpc: " << conn.status().message() << std::endl;
    return 2;
  }
  const std::string command = args[1];
  try {
    Client client(*conn);
    if (command == "list" && args.size() == 2) return List(client);
    if (command == "describe" && args.size() == 3) return Describe(client, args[2]);
    if (command == "call" && (args.size() == 3 || args.size() == 4)) {
      return Call(client, args[2], args.size() == 4 ? args[3] : "{}");
    }
    return usage();
  } catch (const Failure& failure) {
    std::cerr << "modelavg-rpc: " << failure.what() << std::endl;
    return 1;
  }
}
