#include "server/jobs_file.h"

#include <fstream>
#include <sstream>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/job_spec.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"

namespace modelavg::server {
namespace {

// Collects the text-format parser's messages instead of printing them.
class ErrorCollector final : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, google::protobuf::io::ColumnNumber column,
                const std::string& message) override {
    if (!first_.empty()) return;
    first_ = absl::StrCat("line ", line + 1, " column ", column + 1, ": ", message);
  }
  const std::string& first() const { return first_; }

 private:
  std::string first_;
};

absl::StatusOr<v1::JobSpecList> ParseJson(absl::string_view text, const std::string& name) {
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  v1::JobSpecList list;
  std::string json(text);
  if (!json.empty() && json[0] == '[') json = absl::StrCat("{\"jobs\": ", json, "}");
  auto s = google::protobuf::util::JsonStringToMessage(json, &list, options);
  if (s.ok()) return list;
  // Perhaps a single JobSpec.
  v1::JobSpec one;
  if (google::protobuf::util::JsonStringToMessage(json, &one, options).ok()) {
    *list.add_jobs() = std::move(one);
    return list;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(name, " is not valid JSON for JobSpecList {\"jobs\": [JobSpec, ...]} or ",
                   "JobSpec: ", std::string(s.message())));
}

absl::StatusOr<v1::JobSpecList> ParseText(const std::string& text, const std::string& name) {
  v1::JobSpecList list;
  ErrorCollector errors;
  google::protobuf::TextFormat::Parser parser;
  parser.RecordErrorsTo(&errors);
  if (parser.ParseFromString(text, &list)) return list;
  const std::string list_error = errors.first();
  v1::JobSpec one;
  ErrorCollector one_errors;
  google::protobuf::TextFormat::Parser one_parser;
  one_parser.RecordErrorsTo(&one_errors);
  if (one_parser.ParseFromString(text, &one)) {
    *list.add_jobs() = std::move(one);
    return list;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      name, " is neither JSON nor protobuf text format of JobSpecList (jobs { job_id: ... }): ",
      list_error));
}

}  // namespace

absl::StatusOr<std::vector<v1::JobSpec>> ParseJobsFile(const std::string& contents,
                                                       const std::string& name) {
  const absl::string_view trimmed = absl::StripLeadingAsciiWhitespace(contents);
  absl::StatusOr<v1::JobSpecList> list =
      (!trimmed.empty() && (trimmed[0] == '{' || trimmed[0] == '['))
          ? ParseJson(trimmed, name)
          : ParseText(contents, name);
  if (!list.ok()) return list.status();
  std::vector<v1::JobSpec> jobs;
  absl::flat_hash_set<std::string> ids;
  for (int i = 0; i < list->jobs_size(); ++i) {
    const v1::JobSpec& spec = list->jobs(i);
    if (absl::StatusOr<ScheduleSpec> s = ScheduleSpecFromProto(spec); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": job ", i, " (\"", spec.job_id(), "\"): ", s.status().message()));
    }
    if (!ids.insert(spec.job_id()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": job id \"", spec.job_id(), "\" appears twice"));
    }
    jobs.push_back(spec);
  }
  return jobs;
}

}  // namespace modelavg::server
