// The status page over a coordinator core with a fake clock: what the pages show (members, lag,
// generation history with reasons, events, the schedule's next averaging steps), that every value
// is escaped, that no credential shows, and the operator token (bearer header, login cookie).
#include "server/http/status_page.h"

#include <map>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "server/core/job_registry.h"

namespace modelavg::server {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class StatusPageTest : public ::testing::Test {
 protected:
  StatusPageTest() {
    JobRegistryOptions options;
    options.clock = &clock_;
    options.start_staleness_thread = false;
    options.defaults.heartbeat_timeout = absl::Seconds(3);
    registry_ = std::make_unique<JobRegistry>(options);
  }

  // Job `id` of world 4, elastic (min 2), levels (2, 2), (5, 4) (or `levels`, other fields
  // included); every rank joined, rank 0's worker id carrying HTML.
  std::shared_ptr<Job> MakeRunningJob(
      const std::string& id,
      const std::string& levels =
          "levels { period: 2 group_size: 2 } levels { period: 5 group_size: 4 }") {
    v1::JobSpec spec;
    EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(
        absl::StrCat("job_id: '", id, "' world_size: 4 mode: HIERARCHICAL min_world_size: 2 ",
                     levels),
        &spec));
    EXPECT_TRUE(registry_->CreateJob(spec, nullptr).ok());
    std::shared_ptr<Job> job = *registry_->Find(id);
    for (int r = 0; r < 4; ++r) {
      v1::JoinRequest request;
      request.set_job_id(id);
      request.set_worker_id(r == 0 ? "<b>evil</b>&'\"" : absl::StrCat("worker-", r));
      request.set_host(absl::StrCat("host", r));
      request.set_rank(r);
      job->Join(request, absl::InfiniteFuture(), registry_->NewWaitId(),
                [this](absl::StatusOr<v1::JoinResponse> reply) {
                  ASSERT_TRUE(reply.ok()) << reply.status();
                  credentials_[reply->rank()] = reply->credential();
                });
    }
    return job;
  }

  void Beat(Job& job, int rank, int64_t step) {
    v1::HeartbeatRequest hb;
    hb.set_job_id(job.id());
    hb.set_rank(rank);
    v1::Job state;
    job.ToProto(&state);
    hb.set_generation(state.generation());
    hb.set_step(step);
    hb.set_credential(credentials_[rank]);
    v1::HeartbeatResponse reply;
    ASSERT_TRUE(job.Heartbeat(hb, &reply).ok());
  }

  HttpResponse Get(const StatusPage& page, const std::string& path,
                   std::map<std::string, std::string> headers = {},
                   std::map<std::string, std::string> cookies = {}) {
    HttpRequest request;
    request.method = "GET";
    request.path = path;
    request.headers = std::move(headers);
    request.cookies = std::move(cookies);
    return page.Handle(request);
  }

  FakeClock clock_;
  std::unique_ptr<JobRegistry> registry_;
  std::map<int, std::string> credentials_;
};

TEST(HtmlEscapeTest, EscapesEveryMarkupCharacter) {
  EXPECT_EQ(HtmlEscape("<a href=\"x\">'&'</a>"),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;");
  EXPECT_EQ(UrlEncode("a b/<c>"), "a%20b%2F%3Cc%3E");
}

TEST_F(StatusPageTest, Index_ListsJobsWithStateGenerationAndSteps) {
  std::shared_ptr<Job> job = MakeRunningJob("train.v1-a_b");
  for (int r = 0; r < 4; ++r) Beat(*job, r, 10 + r);
  StatusPage page(registry_.get(), {});
  const HttpResponse reply = Get(page, "/");
  EXPECT_EQ(reply.status, 200);
  EXPECT_THAT(reply.body, HasSubstr("href=\"/jobs/train.v1-a_b\">train.v1-a_b</a>"));
  EXPECT_THAT(reply.body, HasSubstr("<span class=\"state RUNNING\">RUNNING</span>"));
  EXPECT_THAT(reply.body, HasSubstr("<td class=\"num\">4 / 4</td>"));
  // min and max step.
  EXPECT_THAT(reply.body, HasSubstr("<td class=\"num\">10</td><td class=\"num\">13</td>"));
}

TEST_F(StatusPageTest, JobPage_MembersLagHistoryTimeline_EscapedWithoutCredentials) {
  std::shared_ptr<Job> job = MakeRunningJob("j");
  for (int r = 0; r < 4; ++r) Beat(*job, r, r == 2 ? 3 : 9);
  StatusPage page(registry_.get(), {});
  std::string body = Get(page, "/jobs/j").body;
  EXPECT_THAT(body, HasSubstr("<span id=\"job-id\">j</span>"));
  EXPECT_THAT(body, HasSubstr("<dd id=\"generation\">1</dd>"));
  // The worker id is text, not markup.
  EXPECT_THAT(body, HasSubstr("&lt;b&gt;evil&lt;/b&gt;&amp;&#39;&quot;"));
  EXPECT_THAT(body, Not(HasSubstr("<b>evil")));
  for (int r = 1; r < 4; ++r) EXPECT_THAT(body, HasSubstr(absl::StrCat("worker-", r)));
  // Rank 2 is 6 steps behind the leader (step 9): flagged.
  EXPECT_THAT(body, HasSubstr("<td class=\"num lagging\">6</td>"));
  // After step 9: 10 (level 1, the world), 12 (level 0), 14, 15, 16, ...
  EXPECT_THAT(body, HasSubstr("<svg id=\"timeline\""));
  EXPECT_THAT(body, HasSubstr("Next averaging steps: 10 (level 1, 1 group of 4), 12 (level 0, "
                              "2 groups of 2), 14 (level 0, 2 groups of 2), 15 (level 1"));
  EXPECT_THAT(body, HasSubstr("world complete"));
  for (const auto& [rank, credential] : credentials_) {
    ASSERT_FALSE(credential.empty());
    EXPECT_THAT(body, Not(HasSubstr(credential))) << "rank " << rank << "'s credential shows";
  }

  // A death (heartbeat timeout): the generation moves, the history says why.
  clock_.Advance(absl::Seconds(2));
  for (int r : {0, 1, 3}) Beat(*job, r, 11);
  clock_.Advance(absl::Seconds(2));
  job->CheckStaleness();
  body = Get(page, "/jobs/j").body;
  EXPECT_THAT(body, HasSubstr("<dd id=\"generation\">2</dd>"));
  EXPECT_THAT(body, HasSubstr("<dd id=\"deaths\">1</dd>"));
  EXPECT_THAT(body, HasSubstr("<tr class=\"member dead\" data-rank=\"2\">"));
  EXPECT_THAT(body, HasSubstr("<dt>vacant ranks</dt><dd>2</dd>"));
  EXPECT_THAT(body, HasSubstr("heartbeat"));
  EXPECT_THAT(body, HasSubstr("generation changed"));
}

// Sharded replicas: the replicas named, the members grouped by replica, the groups of one shard
// in the schedule, and a lost rank's replica retired (one entry of the history).
TEST_F(StatusPageTest, ShardedJob_MembersByReplica_RetiredReplicaShown) {
  std::shared_ptr<Job> job = MakeRunningJob(
      "s",
      "replica_size: 2 levels { period: 2 group_size: 4 } levels { period: 3 group_size: 4 }");
  for (int r = 0; r < 4; ++r) Beat(*job, r, 3);
  StatusPage page(registry_.get(), {});
  std::string body = Get(page, "/jobs/s").body;
  EXPECT_THAT(body, HasSubstr("<dd id=\"replicas\">2 of 2 ranks each"));
  EXPECT_THAT(body, HasSubstr("<tr class=\"replica\" data-replica=\"0\"><th colspan=\"9\">"
                              "replica 0 (ranks 0..1)</th></tr>"));
  EXPECT_THAT(body, HasSubstr("replica 1 (ranks 2..3)"));
  // The replica rows come before their members.
  EXPECT_LT(body.find("data-replica=\"1\""), body.find("data-rank=\"2\""));
  EXPECT_GT(body.find("data-replica=\"1\""), body.find("data-rank=\"1\""));
  EXPECT_THAT(body, HasSubstr("4 (level 0, 2 groups of 2 ranks, one shard each)"));

  clock_.Advance(absl::Seconds(2));
  for (int r : {0, 1, 2}) Beat(*job, r, 5);
  clock_.Advance(absl::Seconds(2));
  job->CheckStaleness();
  body = Get(page, "/jobs/s").body;
  EXPECT_THAT(body, HasSubstr("<span class=\"state RETIRED\">RETIRED</span> (rank 3 lost)"));
  EXPECT_THAT(body, HasSubstr("replica 1 (ranks 2..3) retired"));
  EXPECT_THAT(body, HasSubstr("<dt>vacant ranks</dt><dd>2, 3</dd>"));
}

TEST_F(StatusPageTest, UnknownJob_NotFoundEscaped) {
  StatusPage page(registry_.get(), {});
  const HttpResponse reply = Get(page, "/jobs/<script>");
  EXPECT_EQ(reply.status, 404);
  EXPECT_THAT(reply.body, HasSubstr("&lt;script&gt;"));
  EXPECT_THAT(reply.body, Not(HasSubstr("<script>")));
}

TEST_F(StatusPageTest, WithToken_BearerOrLoginCookie_NeverTheTokenItself) {
  MakeRunningJob("j");
  StatusPageOptions options;
  options.operator_token = "op-token";
  StatusPage page(registry_.get(), options);
  HttpResponse denied = Get(page, "/jobs/j");
  EXPECT_EQ(denied.status, 401);
  EXPECT_THAT(denied.body, HasSubstr("action=\"/login?next=%2Fjobs%2Fj\""));
  EXPECT_THAT(denied.body, Not(HasSubstr("worker-1")));
  EXPECT_EQ(Get(page, "/", {{"authorization", "Bearer nope"}}).status, 401);
  EXPECT_EQ(Get(page, "/jobs/j", {{"authorization", "Bearer op-token"}}).status, 200);
  // Static files need no token (the login page uses them).
  EXPECT_EQ(Get(page, "/static/status.css").status, 200);

  HttpRequest login;
  login.method = "POST";
  login.path = "/login";
  login.query["next"] = "/jobs/j";
  login.form["token"] = "wrong";
  EXPECT_EQ(page.Handle(login).status, 401);
  login.form["token"] = "op-token";
  const HttpResponse ok = page.Handle(login);
  EXPECT_EQ(ok.status, 303);
  std::string cookie, location;
  for (const auto& [name, value] : ok.headers) {
    if (name == "Set-Cookie") cookie = value;
    if (name == "Location") location = value;
  }
  EXPECT_EQ(location, "/jobs/j");
  EXPECT_THAT(cookie, HasSubstr("HttpOnly"));
  EXPECT_THAT(cookie, HasSubstr("SameSite=Strict"));
  EXPECT_THAT(cookie, Not(HasSubstr("op-token")));
  const std::string value = cookie.substr(cookie.find('=') + 1, cookie.find(';') -
                                                                    cookie.find('=') - 1);
  EXPECT_EQ(Get(page, "/jobs/j", {}, {{"modelavg_status", value}}).status, 200);
  EXPECT_EQ(Get(page, "/jobs/j", {}, {{"modelavg_status", value + "0"}}).status, 401);
  // An open redirect is not offered.
  login.query["next"] = "//elsewhere.example/";
  for (const auto& [name, v] : page.Handle(login).headers) {
    if (name == "Location") EXPECT_EQ(v, "/");
  }
}

}  // namespace
}  // namespace modelavg::server
