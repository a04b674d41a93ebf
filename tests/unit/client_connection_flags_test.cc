// The connection options of every program: the flags (client/flags/connection_flags.h), the
// environment (client/rpc/connection.h), their old names, and what a channel takes from them;
// and the blamed rank carried by a typed error (client/base/error_kind.h).
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/time/time.h"
#include "client/base/error_kind.h"
#include "client/flags/connection_flags.h"
#include "client/rpc/connection.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/tools/temp_dir.h"

ABSL_DECLARE_FLAG(std::string, coordinator);
ABSL_DECLARE_FLAG(std::string, auth_token_file);
ABSL_DECLARE_FLAG(bool, tls);
ABSL_DECLARE_FLAG(std::string, tls_ca_file);
ABSL_DECLARE_FLAG(int64_t, rpc_timeout_ms);
ABSL_DECLARE_FLAG(std::string, address);
ABSL_DECLARE_FLAG(std::string, token_file);
ABSL_DECLARE_FLAG(int64_t, timeout_ms);

namespace modelavg::client {
namespace {

using ::testing::HasSubstr;

constexpr const char* kVariables[] = {
    "MODELAVG_COORDINATOR",   "MODELAVG_AUTH_TOKEN_FILE", "MODELAVG_TOKEN_FILE",
    "MODELAVG_AUTH_TOKEN",    "MODELAVG_TLS",             "MODELAVG_TLS_CA_FILE",
    "MODELAVG_TLS_CERT_FILE", "MODELAVG_TLS_KEY_FILE",    "MODELAVG_RPC_TIMEOUT_MS"};

// Each test starts with none of the variables set and the flags at their defaults.
class ConnectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : kVariables) unsetenv(v);
  }
  void TearDown() override {
    for (const char* v : kVariables) unsetenv(v);
  }
  // Writes `text` to a file of the test's directory; its path.
  std::string File(const std::string& name, const std::string& text) {
    const std::string path = dir_.path() + "/" + name;
    std::ofstream(path) << text;
    return path;
  }
  // How many lines of `err` say that `name` is deprecated.
  static int Warnings(const std::string& err, const std::string& name) {
    int n = 0;
    size_t at = 0;
    const std::string line = name + " is deprecated";
    while ((at = err.find(line, at)) != std::string::npos) {
      ++n;
      at += line.size();
    }
    return n;
  }

  absl::FlagSaver flags_;
  testing::TempDir dir_{"connection"};
};

TEST_F(ConnectionTest, ConnectionFromEnvironment_NothingSet_KeepsDefaults) {
  ConnectionOptions defaults;
  defaults.coordinator = "127.0.0.1:50051";
  defaults.rpc_timeout = absl::Seconds(2);
  absl::StatusOr<ConnectionOptions> o = ConnectionFromEnvironment(defaults);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->coordinator, "127.0.0.1:50051");
  EXPECT_EQ(o->rpc_timeout, absl::Seconds(2));
  EXPECT_TRUE(o->auth_token.empty() && o->auth_token_file.empty());
  EXPECT_FALSE(o->tls);
}

TEST_F(ConnectionTest, ConnectionFromEnvironment_NewNames_SetEveryField) {
  setenv("MODELAVG_COORDINATOR", "a:1,b:2", 1);
  setenv("MODELAVG_AUTH_TOKEN_FILE", "/t", 1);
  setenv("MODELAVG_TLS_CA_FILE", "/ca", 1);
  setenv("MODELAVG_TLS_CERT_FILE", "/cert", 1);
  setenv("MODELAVG_TLS_KEY_FILE", "/key", 1);
  setenv("MODELAVG_RPC_TIMEOUT_MS", "2500", 1);
  ::testing::internal::CaptureStderr();
  absl::StatusOr<ConnectionOptions> o = ConnectionFromEnvironment({});
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->coordinator, "a:1,b:2");
  EXPECT_EQ(o->auth_token_file, "/t");
  EXPECT_TRUE(o->tls);  // implied by the TLS files
  EXPECT_EQ(o->tls_ca_file, "/ca");
  EXPECT_EQ(o->tls_cert_file, "/cert");
  EXPECT_EQ(o->tls_key_file, "/key");
  EXPECT_EQ(o->rpc_timeout, absl::Milliseconds(2500));
  EXPECT_EQ(err, "");  // no old name, no warning
}

TEST_F(ConnectionTest, ConnectionFromEnvironment_OldTokenFile_UsedAndReportedOnce) {
  setenv("MODELAVG_TOKEN_FILE", "/old", 1);
  ::testing::internal::CaptureStderr();
  absl::StatusOr<ConnectionOptions> first = ConnectionFromEnvironment({});
  absl::StatusOr<ConnectionOptions> second = ConnectionFromEnvironment({});
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(first->auth_token_file, "/old");
  EXPECT_EQ(Warnings(err, "MODELAVG_TOKEN_FILE"), 1) << err;
  EXPECT_THAT(err, HasSubstr("use MODELAVG_AUTH_TOKEN_FILE"));
  // The new name wins over the old one.
  setenv("MODELAVG_AUTH_TOKEN_FILE", "/new", 1);
  EXPECT_EQ(ConnectionFromEnvironment({})->auth_token_file, "/new");
}

TEST_F(ConnectionTest, ConnectionFromEnvironment_OldTokenItself_SetsTheTokenAndIsReported) {
  setenv("MODELAVG_AUTH_TOKEN", "s3cret", 1);
  ::testing::internal::CaptureStderr();
  absl::StatusOr<ConnectionOptions> o = ConnectionFromEnvironment({});
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->auth_token, "s3cret");
  EXPECT_EQ(Warnings(err, "MODELAVG_AUTH_TOKEN"), 1) << err;
  EXPECT_THAT(err, HasSubstr("MODELAVG_AUTH_TOKEN_FILE"));
  EXPECT_THAT(err, ::testing::Not(HasSubstr("s3cret")));  // never the secret
}

TEST_F(ConnectionTest, ConnectionFromEnvironment_BadValues_InvalidArgumentNamingTheVariable) {
  setenv("MODELAVG_RPC_TIMEOUT_MS", "soon", 1);
  absl::StatusOr<ConnectionOptions> o = ConnectionFromEnvironment({});
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(o.status().message(), HasSubstr("MODELAVG_RPC_TIMEOUT_MS=\"soon\""));
  unsetenv("MODELAVG_RPC_TIMEOUT_MS");
  setenv("MODELAVG_TLS", "maybe", 1);
  o = ConnectionFromEnvironment({});
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(o.status().message(), HasSubstr("MODELAVG_TLS=\"maybe\""));
  setenv("MODELAVG_TLS", "yes", 1);
  EXPECT_TRUE(ConnectionFromEnvironment({})->tls);
}

TEST_F(ConnectionTest, ConnectionFromFlags_Flags_WinOverEnvironmentOverDefaults) {
  setenv("MODELAVG_COORDINATOR", "env:1", 1);
  setenv("MODELAVG_AUTH_TOKEN", "from-env", 1);
  setenv("MODELAVG_RPC_TIMEOUT_MS", "700", 1);
  ConnectionOptions defaults;
  defaults.coordinator = "default:1";
  ::testing::internal::CaptureStderr();
  absl::StatusOr<ConnectionOptions> o = ConnectionFromFlags(defaults);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->coordinator, "env:1");
  EXPECT_EQ(o->rpc_timeout, absl::Milliseconds(700));
  absl::SetFlag(&FLAGS_coordinator, "flag:1");
  absl::SetFlag(&FLAGS_auth_token_file, "/flag-token");
  absl::SetFlag(&FLAGS_tls_ca_file, "/ca");
  absl::SetFlag(&FLAGS_rpc_timeout_ms, 900);
  o = ConnectionFromFlags(defaults);
  ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->coordinator, "flag:1");
  EXPECT_EQ(o->auth_token_file, "/flag-token");
  EXPECT_EQ(o->auth_token, "");  // the flag's token file replaces the environment's token
  EXPECT_TRUE(o->tls);
  EXPECT_EQ(o->rpc_timeout, absl::Milliseconds(900));
}

TEST_F(ConnectionTest, ConnectionFromFlags_OldFlags_UsedAndEachReportedOnceNamingTheNewOne) {
  absl::SetFlag(&FLAGS_address, "old:1");
  absl::SetFlag(&FLAGS_token_file, "/old-token");
  absl::SetFlag(&FLAGS_timeout_ms, 1234);
  ::testing::internal::CaptureStderr();
  absl::StatusOr<ConnectionOptions> o = ConnectionFromFlags();
  absl::StatusOr<ConnectionOptions> again = ConnectionFromFlags();
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(o.ok() && again.ok()) << o.status();
  EXPECT_EQ(o->coordinator, "old:1");
  EXPECT_EQ(o->auth_token_file, "/old-token");
  EXPECT_EQ(o->rpc_timeout, absl::Milliseconds(1234));
  EXPECT_EQ(Warnings(err, "--address"), 1) << err;
  EXPECT_EQ(Warnings(err, "--token_file"), 1) << err;
  EXPECT_EQ(Warnings(err, "--timeout_ms"), 1) << err;
  EXPECT_THAT(err, HasSubstr("--address is deprecated: use --coordinator"));
  EXPECT_THAT(err, HasSubstr("--token_file is deprecated: use --auth_token_file"));
  EXPECT_THAT(err, HasSubstr("--timeout_ms is deprecated: use --rpc_timeout_ms"));
  // Given both, the new name wins.
  absl::SetFlag(&FLAGS_coordinator, "new:1");
  absl::SetFlag(&FLAGS_rpc_timeout_ms, 50);
  EXPECT_EQ(ConnectionFromFlags()->coordinator, "new:1");
  EXPECT_EQ(ConnectionFromFlags()->rpc_timeout, absl::Milliseconds(50));
}

TEST_F(ConnectionTest, ConnectionFromFlags_NegativeTimeout_InvalidArgumentNamingTheFlag) {
  absl::SetFlag(&FLAGS_rpc_timeout_ms, -5);
  absl::StatusOr<ConnectionOptions> o = ConnectionFromFlags();
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(o.status().message(), HasSubstr("--rpc_timeout_ms=-5"));
}

TEST_F(ConnectionTest, AuthTokenOf_File_TheTokenWithoutWhitespace) {
  ConnectionOptions o;
  o.auth_token_file = File("token", "  abc\n");
  EXPECT_EQ(*AuthTokenOf(o), "abc");
  o.auth_token = "xyz";
  EXPECT_EQ(AuthTokenOf(o).status().code(), absl::StatusCode::kInvalidArgument);  // both
  o.auth_token.clear();
  o.auth_token_file = File("empty", "\n");
  EXPECT_THAT(AuthTokenOf(o).status().message(), HasSubstr("is empty"));
  o.auth_token_file = dir_.path() + "/missing";
  EXPECT_THAT(AuthTokenOf(o).status().message(), HasSubstr("auth_token_file"));
  o.auth_token_file.clear();
  o.auth_token = "plain";
  EXPECT_EQ(*AuthTokenOf(o), "plain");
}

TEST_F(ConnectionTest, ChannelCredentialsFor_BadTlsSettings_InvalidArgument) {
  ConnectionOptions o;
  EXPECT_TRUE(ChannelCredentialsFor(o).ok());  // plaintext
  o.tls_key_file = File("key.pem", "k");
  EXPECT_THAT(ChannelCredentialsFor(o).status().message(), HasSubstr("tls is false"));
  o.tls = true;
  EXPECT_THAT(ChannelCredentialsFor(o).status().message(), HasSubstr("go together"));
  o.tls_key_file.clear();
  o.tls_ca_file = dir_.path() + "/missing.pem";
  EXPECT_THAT(ChannelCredentialsFor(o).status().message(), HasSubstr("tls_ca_file"));
}

TEST(ErrorKindTest, SetErrorKind_WithRank_ReadBackWithPeerAndKind) {
  const absl::Status s =
      SetErrorKind(absl::FailedPreconditionError("moved"), ErrorKind::kGenerationMoved, -1, 5);
  EXPECT_EQ(ErrorKindOf(s), ErrorKind::kGenerationMoved);
  EXPECT_EQ(ErrorPeerOf(s), -1);
  EXPECT_EQ(ErrorRankOf(s), 5);
  EXPECT_EQ(ErrorRankOf(SetErrorKind(absl::AbortedError("x"), ErrorKind::kPeerFailure, 2)), -1);
  // A payload of the two-field form ("<kind>,<peer>") reads with no rank.
  absl::Status two = absl::UnavailableError("y");
  two.SetPayload(kErrorKindPayloadUrl, absl::Cord("2,1"));
  EXPECT_EQ(ErrorKindOf(two), ErrorKind::kPeerFailure);
  EXPECT_EQ(ErrorPeerOf(two), 1);
  EXPECT_EQ(ErrorRankOf(two), -1);
}

}  // namespace
}  // namespace modelavg::client
