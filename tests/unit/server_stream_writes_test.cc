// StreamWrites, the one-write-in-flight queue of the streaming reactors, against a fake reactor
// that records what it is asked to do and completes writes only when the test says so.
#include "server/rpc/stream_writes.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace modelavg::server {
namespace {

grpc::ByteBuffer Bytes(const std::string& text) {
  grpc::Slice slice(text);
  return grpc::ByteBuffer(&slice, 1);
}

std::string Text(const grpc::ByteBuffer& bytes) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(bytes.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

struct FakeReactor {
  void StartWrite(const grpc::ByteBuffer* bytes) { started.push_back(Text(*bytes)); }
  void Finish(const grpc::Status& status) {
    ++finishes;
    finish = status;
  }
  std::vector<std::string> started;
  int finishes = 0;
  grpc::Status finish;
};

using Writes = StreamWrites<FakeReactor>;

TEST(StreamWritesTest, Write_OneInFlight_TheNextStartsWhenItCompletes) {
  FakeReactor r;
  Writes w(&r, 8, Writes::WhenFull::kRefuse, "broke");
  EXPECT_EQ(w.Write(Bytes("a")), Writes::Queued::kWriting);
  EXPECT_EQ(w.Write(Bytes("b")), Writes::Queued::kWaiting);
  EXPECT_EQ(w.Write(Bytes("c")), Writes::Queued::kWaiting);
  EXPECT_THAT(r.started, testing::ElementsAre("a"));
  EXPECT_FALSE(w.OnWriteDone(true));
  EXPECT_THAT(r.started, testing::ElementsAre("a", "b"));
  EXPECT_FALSE(w.OnWriteDone(true));
  EXPECT_TRUE(w.OnWriteDone(true));  // idle
  EXPECT_THAT(r.started, testing::ElementsAre("a", "b", "c"));
  EXPECT_EQ(w.Write(Bytes("d")), Writes::Queued::kWriting);
  EXPECT_EQ(r.finishes, 0);
}

TEST(StreamWritesTest, Refuse_FullQueue_RefusedAndTheQueueKept) {
  FakeReactor r;
  Writes w(&r, 1, Writes::WhenFull::kRefuse, "broke");
  EXPECT_EQ(w.Write(Bytes("a")), Writes::Queued::kWriting);
  EXPECT_EQ(w.Write(Bytes("b")), Writes::Queued::kWaiting);
  EXPECT_EQ(w.Write(Bytes("c")), Writes::Queued::kFull);
  w.OnWriteDone(true);
  EXPECT_TRUE(w.OnWriteDone(true));
  EXPECT_THAT(r.started, testing::ElementsAre("a", "b"));
}

TEST(StreamWritesTest, ReplaceNewest_FullQueue_OnlyTheLatestGoesOut) {
  FakeReactor r;
  Writes w(&r, 1, Writes::WhenFull::kReplaceNewest, "broke");
  EXPECT_EQ(w.Write(Bytes("a")), Writes::Queued::kWriting);
  EXPECT_EQ(w.Write(Bytes("b")), Writes::Queued::kWaiting);
  EXPECT_EQ(w.Write(Bytes("c")), Writes::Queued::kWaiting);
  w.OnWriteDone(true);
  EXPECT_TRUE(w.OnWriteDone(true));
  EXPECT_THAT(r.started, testing::ElementsAre("a", "c"));
}

TEST(StreamWritesTest, End_WhileWriting_FinishesAfterTheQueuedWrites) {
  FakeReactor r;
  Writes w(&r, 8, Writes::WhenFull::kRefuse, "broke");
  w.Write(Bytes("a"));
  w.Write(Bytes("b"));
  w.End(absl::NotFoundError("gone"));
  EXPECT_TRUE(w.ending());
  EXPECT_EQ(w.Write(Bytes("late")), Writes::Queued::kFinishing);
  w.End(absl::InternalError("second end"));  // the first stands
  EXPECT_EQ(r.finishes, 0);
  EXPECT_EQ(w.final_code(), absl::StatusCode::kOk);  // not finished yet
  EXPECT_FALSE(w.OnWriteDone(true));
  EXPECT_EQ(r.finishes, 0);
  EXPECT_FALSE(w.OnWriteDone(true));
  EXPECT_THAT(r.started, testing::ElementsAre("a", "b"));
  EXPECT_EQ(r.finishes, 1);
  EXPECT_EQ(r.finish.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(w.final_code(), absl::StatusCode::kNotFound);
}

TEST(StreamWritesTest, End_Idle_FinishesAtOnce) {
  FakeReactor r;
  Writes w(&r, 8, Writes::WhenFull::kRefuse, "broke");
  w.End(absl::OkStatus());
  EXPECT_EQ(r.finishes, 1);
  EXPECT_TRUE(r.finish.ok());
  EXPECT_EQ(w.Write(Bytes("a")), Writes::Queued::kFinishing);
  EXPECT_TRUE(r.started.empty());
}

TEST(StreamWritesTest, FailedWrite_FinishesCancelledAndDropsTheQueue) {
  FakeReactor r;
  Writes w(&r, 8, Writes::WhenFull::kRefuse, "the stream broke");
  w.Write(Bytes("a"));
  w.Write(Bytes("b"));
  EXPECT_FALSE(w.OnWriteDone(false));
  EXPECT_THAT(r.started, testing::ElementsAre("a"));
  EXPECT_EQ(r.finishes, 1);
  EXPECT_EQ(r.finish.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(r.finish.error_message(), "the stream broke");
  EXPECT_EQ(w.Write(Bytes("c")), Writes::Queued::kFinishing);
}

TEST(StreamWritesTest, FailedWrite_AfterEnd_KeepsTheEndsStatus) {
  FakeReactor r;
  Writes w(&r, 8, Writes::WhenFull::kRefuse, "broke");
  w.Write(Bytes("a"));
  w.End(absl::InvalidArgumentError("bad beat"));
  w.OnWriteDone(false);
  EXPECT_EQ(r.finishes, 1);
  EXPECT_EQ(r.finish.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST(StreamWritesTest, Detach_ReactorGone_NothingIsCalled) {
  FakeReactor r;
  Writes w(&r, 8, Writes::WhenFull::kRefuse, "broke");
  w.Detach();
  EXPECT_TRUE(w.ending());
  EXPECT_EQ(w.Write(Bytes("a")), Writes::Queued::kFinishing);
  w.End(absl::OkStatus());
  EXPECT_TRUE(r.started.empty());
  EXPECT_EQ(r.finishes, 0);
}

}  // namespace
}  // namespace modelavg::server
