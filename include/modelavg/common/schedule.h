// The averaging schedule: a pure function of a job's plan and a step.
//
// It reproduces PyTorch's torch.distributed.algorithms.model_averaging exactly:
//   * PeriodicModelAverager(period, warmup_steps): average over the whole world at step s iff
//     s >= warmup_steps && (s - warmup_steps) % period == 0 (phase relative to warm-up).
//   * HierarchicalModelAverager(period_group_size_dict, warmup_steps): at s >= warmup_steps walk
//     the levels from last to first and take the first whose period divides s (phase absolute;
//     warm-up only masks). No level divides: no averaging.
// With sharded replicas (ScheduleSpec::replica_size S > 1) rank r holds shard r % S of replica
// r / S, and at a level of group size g it averages with the ranks of its block that hold its
// shard: { g * (r / g) + i * S + r % S : 0 <= i < g / S } (docs/sharded.md).
// The coordinator, the client's decision cache and the tests share this one implementation.
#ifndef MODELAVG_COMMON_SCHEDULE_H_
#define MODELAVG_COMMON_SCHEDULE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "modelavg/common/payload.h"

namespace modelavg {

enum class AveragingMode { kPeriodic, kHierarchical };

// A level's outer optimizer (DiLoCo): PyTorch's SGD on the member's anchor with the group's
// mean pseudo-gradient (anchor - parameters) as the gradient. See client/outer/outer_state.h.
struct OuterSgd {
  double lr = 1.0;
  double momentum = 0.0;
  bool nesterov = false;

  bool operator==(const OuterSgd& o) const {
    return lr == o.lr && momentum == o.momentum && nesterov == o.nesterov;
  }
};


struct ScheduleLevel {
  int64_t period = 0;
  int32_t group_size = 0;
  // Absent: the level's members average their parameters (PyTorch's averagers).
  std::optional<OuterSgd> outer;
  // Streaming sync (docs/streaming.md). The parameters are split into `fragments` fragments;
  // the level acts every period / fragments steps on one of them (see Schedule::LevelAt).
  int32_t fragments = 1;
  // Outer levels: a fragment's all-reduce starts at its sync step s and is applied at
  // s + sync_delay, mixing (1 - mix) * anchor + mix * local; pseudo-gradients sent as `payload`.
  int64_t sync_delay = 0;
  double mix = 0.0;
  Payload payload = Payload::kFp32;
  // Error feedback's decay beta (0: off): each member sends U = beta * E + D and keeps
  // E := U - decode(encode(U)) (docs/streaming.md). Needs a compressed payload.
  double error_feedback = 0.0;
  // A top-k payload (PayloadInfo::topk): the fraction of each block's entries sent, in (0, 1).
  double topk_density = 0.0;
  // Paced rounds (docs/paced.md): each group of the level (PacedGroupSize consecutive ranks)
  // takes its own number of inner steps between two rounds, `period` being the slowest group's.
  // Only the last level may be paced. The schedule itself does not read it: the coordinator
  // plans a paced level's sync steps (server/pacing/pacing.h).
  bool paced = false;
  // Paced levels of an elastic job: a group more than max_lag x its expected round time behind
  // is failed out as a straggler. 0: no bound.
  double max_lag = 0.0;
  // Paced levels: the job's length in rounds of the level (0: no bound). After round rounds - 1
  // a member's budget is spent and no further round is planned.
  int64_t rounds = 0;

  // The hierarchy walk's period of this level: period / fragments.
  int64_t StepPeriod() const { return fragments > 1 ? period / fragments : period; }
};

// The part of a job spec the schedule depends on.
struct ScheduleSpec {
  int32_t world_size = 0;
  int64_t warmup_steps = 0;
  AveragingMode mode = AveragingMode::kHierarchical;
  std::vector<ScheduleLevel> levels;
  // The ranks of one model replica (JobSpec.replica_size; 1: every rank holds a whole one).
  int32_t replica_size = 1;
};

// Largest world a job may have.
inline constexpr int32_t kMaxWorldSize = 65536;
// Most levels a job may have. PyTorch's hierarchies have a handful; every level costs work on
// every step of every schedule query.
inline constexpr size_t kMaxLevels = 16;
// Largest period and warm-up: 10^12 steps (31 years at a step a millisecond). Keeps every
// step arithmetic far from int64 overflow.
inline constexpr int64_t kMaxPeriod = 1'000'000'000'000;
inline constexpr int64_t kMaxWarmupSteps = 1'000'000'000'000;
// How many multiples of a level's period Schedule::FirstStepOf looks at.
inline constexpr int64_t kFirstStepSearch = 1'000'000;
// Most fragments a level may have.
inline constexpr int32_t kMaxFragments = 4096;

// Checks every rule of DESIGN.md; INVALID_ARGUMENT naming the field and the value otherwise:
// world_size outside [1, kMaxWorldSize], warmup_steps outside [0, kMaxWarmupSteps], no levels or
// more than kMaxLevels, period outside [1, kMaxPeriod], group size
// <= 0, > world_size or not dividing world_size, the last level's group size != world_size,
// duplicate periods (PyTorch keys its levels by period), for kPeriodic anything but exactly
// one level, an outer optimizer whose lr is not finite and > 0, whose momentum is outside
// [0, 1), or that asks for nesterov with momentum 0 (PyTorch's SGD rules), the streaming
// fields of each level (ValidateStreamingLevel), and a replica_size below 1 or not dividing
// world_size and every level's group size, and the paced levels' rules (ValidatePacing).
absl::Status ValidateScheduleSpec(const ScheduleSpec& spec);

// The replica size of `spec` (the rest of it valid): >= 1, dividing world_size and every
// level's group size. INVALID_ARGUMENT naming the field and the values otherwise.
absl::Status ValidateReplicaSize(const ScheduleSpec& spec);

// The streaming fields of `levels[index]` (`outer`: the level has an outer optimizer):
// fragments in [1, kMaxFragments] and dividing the period; sync_delay in [0, period /
// fragments); mix in [0, 1]; and sync_delay, mix and a compressed payload only on an outer
// level. INVALID_ARGUMENT naming the field otherwise.
absl::Status ValidateStreamingLevel(const ScheduleLevel& level, size_t index, bool outer);

// The largest max_lag a paced level may have.
inline constexpr double kMaxMaxLag = 1e6;
// The most rounds a paced job may count (ScheduleLevel::rounds).
inline constexpr int64_t kMaxPacedRounds = int64_t{1} << 40;

// The rules of a paced level (docs/paced.md) on `spec` (the rest of it valid): only the last
// level may be paced, and it must have at least two groups to pace (PacedGroupSize below
// world_size); max_lag is 0 or in [1, kMaxMaxLag], and non-zero only on a paced level; rounds is in
// [0, kMaxPacedRounds], and non-zero only on a paced level.
// INVALID_ARGUMENT naming the field otherwise. That max_lag needs an elastic job is a rule of
// the job spec (job_spec.h), which knows min_world_size.
absl::Status ValidatePacing(const ScheduleSpec& spec);

// The ranks a paced level at `level` (the last) paces as one group: the ranks that the lower
// levels' groups and the replicas lock together by their own collectives, which always take the
// same steps. Blocks of consecutive ranks, lcm(replica_size, group_size of every level below
// `level`) of them (each divides world_size, so their lcm does). Precondition: a valid spec.
int32_t PacedGroupSize(const ScheduleSpec& spec, size_t level);

// Things PyTorch only warns about (largest period 1, periods not ascending — step periods,
// period / fragments, for fragmented levels): valid, but likely not what the user meant.
std::vector<std::string> ScheduleWarnings(const ScheduleSpec& spec);

// A rank's subgroup at one level: the `size` ranks first_rank + i * stride, 0 <= i < size. The
// stride is the job's replica size (1: a block of consecutive ranks).
struct SubgroupRange {
  int32_t index = 0;
  int32_t first_rank = 0;
  int32_t size = 0;
  int32_t stride = 1;

  std::vector<int32_t> Ranks() const;
  // The i-th member rank, 0 <= i < size.
  int32_t RankAt(int32_t i) const { return first_rank + i * stride; }
  // The last member rank.
  int32_t LastRank() const { return RankAt(size - 1); }
  bool Contains(int32_t rank) const {
    return rank >= first_rank && (rank - first_rank) % stride == 0 &&
           (rank - first_rank) / stride < size;
  }
  // The position of `rank` among the members. Precondition: Contains(rank).
  int32_t IndexOf(int32_t rank) const { return (rank - first_rank) / stride; }
  // "4..7" for consecutive ranks, "1,3,5,7" otherwise (for messages).
  std::string Describe() const;

  bool operator==(const SubgroupRange& o) const {
    return index == o.index && first_rank == o.first_rank && size == o.size &&
           (size <= 1 || stride == o.stride);
  }
};

// What one rank does at one step.
struct Decision {
  int64_t step = 0;
  bool average = false;
  // Index into the spec's levels; -1 when !average.
  int32_t level = -1;
  int64_t period = 0;
  // The fragment of the level's parameters synced at this step, in [0, fragments), and the
  // level's fragment count (1: the whole model). Meaningful only when average.
  int32_t fragment = 0;
  int32_t fragments = 1;
  // The subgroup that averages (meaningful only when average).
  SubgroupRange subgroup;
  // The ranks that actually average (AVERAGE only): the subgroup's ranks, less the vacant ranks
  // of an elastic job and the replacements not admitted yet. Empty means the whole subgroup
  // (a decision of the schedule alone, which knows nothing of membership).
  std::vector<int32_t> members;
  // Members admitted at this step (elastic replacements): they receive the average of the
  // others and contribute nothing. Usually empty.
  std::vector<int32_t> joining;
  // The job generation the decision was taken in (0: not known).
  int64_t generation = 0;
  // The version of the job's plan the decision follows (plan_history.h): `level` indexes that
  // plan's levels. 0: the plan the job was created with.
  int32_t plan = 0;

  // The chosen level has an outer optimizer (ScheduleLevel::outer; average only).
  bool outer = false;

  // A paced level's round (docs/paced.md): its index from 0; -1 on every other decision. Paced
  // decisions come from the coordinator's plan, not from the schedule.
  int64_t round = -1;
  // A paced round: each member's weight, in the order of Members() (a joining member's is 0).
  // The round's result is sum(w_i x_i) / sum(w_i). Empty: every member weighs the same.
  std::vector<double> weights;

  // The ranks averaging: `members`, or the whole subgroup when it is empty.
  std::vector<int32_t> Members() const {
    return members.empty() ? subgroup.Ranks() : members;
  }

  // Compares what the schedule decides (step, level, subgroup), not the membership.
  bool operator==(const Decision& o) const {
    return step == o.step && average == o.average && level == o.level && period == o.period &&
           fragment == o.fragment && fragments == o.fragments && subgroup == o.subgroup &&
           plan == o.plan;
  }
};

// A validated spec and the decisions it implies. Cheap to copy.
class Schedule {
 public:
  // INVALID_ARGUMENT as ValidateScheduleSpec.
  static absl::StatusOr<Schedule> Create(ScheduleSpec spec);

  const ScheduleSpec& spec() const { return spec_; }
  int32_t world_size() const { return spec_.world_size; }
  // The ranks of one replica (1 without sharded replicas).
  int32_t replica_size() const { return spec_.replica_size; }
  // The replica `rank` belongs to, and the shard it holds.
  int32_t ReplicaOf(int32_t rank) const { return rank / spec_.replica_size; }
  int32_t ShardOf(int32_t rank) const { return rank % spec_.replica_size; }
  int32_t num_replicas() const { return spec_.world_size / spec_.replica_size; }
  int num_levels() const { return static_cast<int>(spec_.levels.size()); }

  // The level that averages at `step` (the same for every rank), or -1. O(levels).
  // A level of F fragments takes part in the walk with its step period H / F (H its period):
  // periodic, it acts at s >= warmup with (s - warmup) % (H / F) == 0; hierarchical, the walk
  // from the last level to the first takes the first level whose H / F divides s. Example:
  // levels (period 4, group 2) and (period 8, group 4, fragments 4): the second level's step
  // period is 2, so it takes every even step (fragments 0, 1, 2, 3, 0, ... at steps 0, 2, 4,
  // 6, 8, ...) and outranks the first level at every step the first would have taken.
  // Precondition: step >= 0.
  int LevelAt(int64_t step) const;

  // The fragment `level` syncs at `step`, when it acts there: (s / (H / F)) mod F, with s taken
  // from warm-up in a periodic job (s - warmup). 0 for a level of one fragment.
  int32_t FragmentAt(int level, int64_t step) const;

  // The subgroup of `rank` at `level`: the ranks of its block of group_size that hold its shard,
  // index (rank / group_size) * replica_size + rank % replica_size. Precondition:
  // 0 <= rank < world_size, valid level.
  SubgroupRange SubgroupOf(int level, int32_t rank) const;

  // How many subgroups `level` has: world_size / group_size * replica_size.
  int32_t NumSubgroups(int level) const;

  // The subgroup of that index at `level`. Precondition: 0 <= index < NumSubgroups(level).
  SubgroupRange Subgroup(int level, int32_t index) const;

  // Every subgroup at `level`, in index order.
  std::vector<SubgroupRange> SubgroupsAt(int level) const;

  // The first step >= warmup at which `level` averages, or -1 if there is none within
  // kFirstStepSearch of its period's multiples (a level shadowed by a later one). The first
  // averaging step of an outer level sets the anchors.
  int64_t FirstStepOf(int level) const { return FirstStepFrom(level, 0); }

  // The first step >= max(from, warmup) at which `level` averages, or -1 as FirstStepOf. After
  // a plan change at step E, FirstStepFrom(level, E) is where a level that starts afresh sets
  // its anchors (plan_history.h).
  int64_t FirstStepFrom(int level, int64_t from) const;

  // The first step >= max(from, warmup) at which `level` syncs `fragment`, or -1 within
  // kFirstStepSearch of its step period's multiples.
  int64_t FirstSyncFrom(int level, int32_t fragment, int64_t from) const;

  // What `rank` does at `step`. Precondition: step >= 0, 0 <= rank < world_size.
  Decision DecisionFor(int64_t step, int32_t rank) const;

  // Paced rounds (docs/paced.md). The paced level: the last level when it is paced, else -1.
  int PacedLevel() const;
  // What `rank` does at `step` by the levels below the paced one alone (LevelAt's walk without
  // the paced level: a SKIP in a PERIODIC job, whose one level is the paced one). A paced
  // member's decision at a step that is not one of its sync steps. Precondition: PacedLevel() >= 0.
  Decision DecisionBelowPaced(int64_t step, int32_t rank) const;
  // The paced level's decision for `rank` at `step`, its sync step of round `round`, syncing
  // `fragment`. Precondition: PacedLevel() >= 0.
  Decision PacedDecision(int64_t step, int32_t rank, int64_t round, int32_t fragment) const;

  // Decisions of `rank` for steps [from_step, from_step + count). O(count * levels).
  std::vector<Decision> Window(int64_t from_step, int64_t count, int32_t rank) const;

  // Like Window, but for every rank at once: a SKIP step gives one decision, an averaging step
  // one decision per subgroup of the chosen level.
  std::vector<Decision> WindowAllSubgroups(int64_t from_step, int64_t count) const;

 private:
  explicit Schedule(ScheduleSpec spec) : spec_(std::move(spec)) {}
  // The decision of `group` at `step`, where `level` (>= 0) averages.
  Decision AveragingDecision(int64_t step, int level, const SubgroupRange& group) const;
  ScheduleSpec spec_;
};

}  // namespace modelavg

#endif  // MODELAVG_COMMON_SCHEDULE_H_
