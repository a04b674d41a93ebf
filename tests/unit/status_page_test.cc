// The status page over a coordinator core with a fake clock: what the pages show (members, lag,
// generation history with reasons, events, the schedule's next averaging steps), that every value
// is escaped, that no credential shows, and the operator token (bearer header, login cookie).
#include "server/http/status_page.h"

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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

// A level's compressed payload and error feedback show beside its period.
TEST_F(StatusPageTest, JobPage_ShowsPayloadAndErrorFeedback) {
  v1::JobSpec spec;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
      "job_id: 'fb' world_size: 2 mode: PERIODIC levels { period: 4 group_size: 2 "
      "outer { lr: 1 } payload: TOPK topk_density: 0.02 error_feedback: 0.9 }",
      &spec));
  ASSERT_TRUE(registry_->CreateJob(spec, nullptr).ok());
  StatusPage page(registry_.get(), {});
  const std::string body = Get(page, "/jobs/fb").body;
  EXPECT_THAT(body, HasSubstr("every 4 steps in groups of 2, payload TOPK (density 0.02), "
                              "error feedback 0.9"));
}

// UpdateJob: the page shows the pending plan with its switch step (the timeline stops before
// it), then, once every member passed it, the plan history with the new plan in force.
TEST_F(StatusPageTest, JobPage_PlanUpdated_PendingPlanThenHistory) {
  std::shared_ptr<Job> job = MakeRunningJob("p");
  for (int r = 0; r < 4; ++r) Beat(*job, r, 10);
  StatusPage page(registry_.get(), {});
  std::string body = Get(page, "/jobs/p").body;
  EXPECT_THAT(body, HasSubstr("<table id=\"plans\">"));
  EXPECT_THAT(body, HasSubstr("<tr class=\"plan\" data-version=\"0\"><td class=\"num\">0</td>"
                              "<td class=\"num\">0</td>"));
  EXPECT_THAT(body, Not(HasSubstr("pending plan")));

  v1::UpdateJobRequest update;
  update.set_job_id("p");
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
      "job_id: 'p' world_size: 4 mode: HIERARCHICAL min_world_size: 2 "
      "levels { period: 4 group_size: 2 } "
      "levels { period: 5 group_size: 4 outer { lr: 0.5 momentum: 0.9 } }",
      update.mutable_spec()));
  std::optional<absl::StatusOr<v1::UpdateJobResponse>> answer;
  job->UpdateJob(update, [&](absl::StatusOr<v1::UpdateJobResponse> r) { answer = std::move(r); });
  ASSERT_FALSE(answer.has_value()) << "answered before the members gave back their decisions";
  // Each member learns of the proposal from a beat and answers it: it uses its decisions
  // through step 12.
  for (int r = 0; r < 4; ++r) {
    v1::HeartbeatRequest hb;
    hb.set_job_id("p");
    hb.set_rank(r);
    hb.set_generation(1);
    hb.set_step(10);
    hb.set_credential(credentials_[r]);
    v1::HeartbeatResponse reply;
    ASSERT_TRUE(job->Heartbeat(hb, &reply).ok());
    ASSERT_EQ(reply.proposed_plan(), 1);
    hb.set_used_through(12);
    hb.set_proposal_answered(1);
    ASSERT_TRUE(job->Heartbeat(hb, &reply).ok());
  }
  ASSERT_TRUE(answer.has_value());
  ASSERT_TRUE(answer->ok()) << answer->status();
  const int64_t e = (*answer)->switch_step();
  ASSERT_GT(e, 12);
  body = Get(page, "/jobs/p").body;
  EXPECT_THAT(body, HasSubstr(absl::StrCat(
                        "<dd id=\"pending-plan\">version 1 from step ", e,
                        ": hierarchical, warm-up 0 steps; every 4 steps in groups of 2; every 5 "
                        "steps in groups of 4, outer lr 0.5 momentum 0.9</dd>")));
  EXPECT_THAT(body, HasSubstr(absl::StrCat("<tr class=\"plan\" data-version=\"1\"><td "
                                           "class=\"num\">1</td><td class=\"num\">", e,
                                           "</td>")));
  EXPECT_THAT(body, HasSubstr("<td>pending</td>"));
  EXPECT_THAT(body, HasSubstr(absl::StrCat("plan version 1 takes over at step ", e)));
  // The timeline stops before the switch: the old plan's averaging steps from 11 to e - 1 (the
  // last level whose period divides the step).
  std::vector<std::string> marks;
  for (int64_t s = 11; s < e; ++s) {
    if (s % 5 == 0) marks.push_back(absl::StrCat(s, " (level 1, 1 group of 4)"));
    else if (s % 2 == 0) marks.push_back(absl::StrCat(s, " (level 0, 2 groups of 2)"));
  }
  ASSERT_FALSE(marks.empty());
  EXPECT_THAT(body, HasSubstr(absl::StrCat("Next averaging steps: ", absl::StrJoin(marks, ", "),
                                           "</p>")));

  for (int r = 0; r < 4; ++r) Beat(*job, r, e);
  body = Get(page, "/jobs/p").body;
  EXPECT_THAT(body, Not(HasSubstr("pending-plan")));
  EXPECT_THAT(body, HasSubstr("<dd id=\"plan\">hierarchical, warm-up 0 steps; every 4 steps in "
                              "groups of 2; every 5 steps in groups of 4, outer lr 0.5 momentum "
                              "0.9 (version 1)</dd>"));
  EXPECT_THAT(body, HasSubstr("<td>in force</td><td>hierarchical, warm-up 0 steps; every 4"));
  EXPECT_THAT(body, HasSubstr("<td>past</td><td>hierarchical, warm-up 0 steps; every 2"));
  EXPECT_THAT(body, HasSubstr("plan updated"));
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

// A POST /login with `token` and `next`; the reply's Location and the session cookie's value
// (each "" when absent).
struct LoginReply {
  int status = 0;
  std::string location, cookie, set_cookie;
};
LoginReply LogIn(const StatusPage& page, const std::string& token, const std::string& next) {
  HttpRequest login;
  login.method = "POST";
  login.path = "/login";
  login.query["next"] = next;
  login.form["token"] = token;
  const HttpResponse reply = page.Handle(login);
  LoginReply out;
  out.status = reply.status;
  for (const auto& [name, value] : reply.headers) {
    if (name == "Location") out.location = value;
    if (name == "Set-Cookie") {
      out.set_cookie = value;
      const size_t eq = value.find('=');
      out.cookie = value.substr(eq + 1, value.find(';') - eq - 1);
    }
  }
  return out;
}

// POST /login?next=/%5Cevil.example answered "Location: /\evil.example", which browsers take for
// another host. Now only a page of this server ("/" or "/jobs/<id>") is gone back to; anything
// else (absolute URLs, //host, backslashes, control characters, other paths) becomes "/", in the
// redirect and in the login form alike.
TEST_F(StatusPageTest, Login_NextOffThisServer_ReplacedBySlash) {
  MakeRunningJob("j");
  StatusPageOptions options;
  options.operator_token = "op-token";
  StatusPage page(registry_.get(), options);
  for (const std::string& next :
       {std::string("/\\evil.example"), std::string("/\\/evil.example"),
        std::string("//evil.example/"), std::string("///evil.example"),
        std::string("https://evil.example/"), std::string("javascript:alert(1)"),
        std::string("/\t/evil.example"), std::string("/jobs/j\r\nSet-Cookie: x=1"),
        std::string("/jobs/../..//evil.example"), std::string("/jobs/j/../../x"),
        std::string("/%5Cevil.example"), std::string("evil.example"), std::string("")}) {
    const LoginReply reply = LogIn(page, "op-token", next);
    EXPECT_EQ(reply.status, 303) << next;
    EXPECT_EQ(reply.location, "/") << next;
    HttpRequest form;
    form.method = "GET";
    form.path = "/login";
    form.query["next"] = next;
    EXPECT_THAT(page.Handle(form).body, HasSubstr("action=\"/login?next=%2F\"")) << next;
  }
  for (const std::string& next : {std::string("/"), std::string("/jobs/j"),
                                  std::string("/jobs/train.v1-a_b")}) {
    EXPECT_EQ(LogIn(page, "op-token", next).location, next);
  }
}

// The login cookie was an HMAC of the token with a fixed message: it kept working after
// /logout and across restarts. Now it is a session: /logout ends it on the server (a copy of
// the cookie is refused too), it expires (12 h by default), and a restart ends every one.
TEST_F(StatusPageTest, Logout_EndsTheSession_CopiedCookieRefused) {
  MakeRunningJob("j");
  StatusPageOptions options;
  options.operator_token = "op-token";
  StatusPage page(registry_.get(), options);
  const LoginReply login = LogIn(page, "op-token", "/jobs/j");
  ASSERT_FALSE(login.cookie.empty());
  EXPECT_THAT(login.set_cookie, HasSubstr("Max-Age="));
  EXPECT_THAT(login.set_cookie, HasSubstr("HttpOnly"));
  EXPECT_THAT(login.set_cookie, HasSubstr("SameSite=Strict"));
  EXPECT_EQ(Get(page, "/jobs/j", {}, {{"modelavg_status", login.cookie}}).status, 200);
  // Two logins are two sessions: ending one leaves the other.
  const LoginReply other = LogIn(page, "op-token", "/");
  EXPECT_NE(other.cookie, login.cookie);
  const HttpResponse out = Get(page, "/logout", {}, {{"modelavg_status", login.cookie}});
  EXPECT_EQ(out.status, 303);
  EXPECT_EQ(Get(page, "/jobs/j", {}, {{"modelavg_status", login.cookie}}).status, 401);
  EXPECT_EQ(Get(page, "/jobs/j", {}, {{"modelavg_status", other.cookie}}).status, 200);
}

TEST_F(StatusPageTest, Login_Expires) {
  MakeRunningJob("j");
  StatusPageOptions options;
  options.operator_token = "op-token";
  StatusPage page(registry_.get(), options);
  const LoginReply login = LogIn(page, "op-token", "/");
  EXPECT_EQ(Get(page, "/", {}, {{"modelavg_status", login.cookie}}).status, 200);
  clock_.Advance(absl::Hours(11));
  EXPECT_EQ(Get(page, "/", {}, {{"modelavg_status", login.cookie}}).status, 200);
  clock_.Advance(absl::Hours(2));
  EXPECT_EQ(Get(page, "/", {}, {{"modelavg_status", login.cookie}}).status, 401);
}

TEST_F(StatusPageTest, Restart_EndsEveryLogin) {
  MakeRunningJob("j");
  StatusPageOptions options;
  options.operator_token = "op-token";
  std::string cookie;
  {
    StatusPage before(registry_.get(), options);
    cookie = LogIn(before, "op-token", "/").cookie;
    EXPECT_EQ(Get(before, "/", {}, {{"modelavg_status", cookie}}).status, 200);
  }
  StatusPage after(registry_.get(), options);  // the same token, a new process
  EXPECT_EQ(Get(after, "/", {}, {{"modelavg_status", cookie}}).status, 401);
}

}  // namespace
}  // namespace modelavg::server
