#include "client/averaging/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/status_util.h"

namespace modelavg::client {

AveragerState Checkpoint::Save(int64_t step, const OuterLevel& outer,
                               StreamingLevel& streaming) const {
  AveragerState out;
  out.step = step;
  for (const auto& state : outer.states()) {
    if (state == nullptr || !state->has_anchor()) continue;
    out.anchors[state->level()] = state->AnchorTensors();
    if (state->has_momentum()) out.momenta[state->level()] = state->MomentumTensors();
  }
  SaveStreaming(streaming, &out);
  return out;
}

absl::StatusOr<Checkpoint::Restored> Checkpoint::Restore(const AveragerState& state) const {
  // The levels of the plan in force at the saved step (docs/plan-updates.md).
  const Schedule& plan = client_->plans().At(std::max<int64_t>(0, state.step));
  const std::vector<ScheduleLevel>& spec_levels = plan.spec().levels;
  const int levels = static_cast<int>(spec_levels.size());
  auto check_level = [&](int level, const char* what) -> absl::Status {
    if (level < 0 || level >= levels) {
      return absl::InvalidArgumentError(absl::StrCat(what, " has level ", level, "; the job has ",
                                                     levels, " levels"));
    }
    if (!spec_levels[level].outer.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " has level ", level, ", which has no outer optimizer in job ",
          client_->job_id(), ": was the state_dict saved from another job's averager?"));
    }
    if (StreamingOuterLevel(spec_levels[level])) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " has level ", level, ", a streaming level of job ", client_->job_id(),
          ", whose state is per fragment (AveragerState::fragments)"));
    }
    return absl::OkStatus();
  };
  for (const auto& [level, tensors] : state.anchors) {
    MODELAVG_RETURN_IF_ERROR(check_level(level, "anchors"));
  }
  for (const auto& [level, tensors] : state.momenta) {
    MODELAVG_RETURN_IF_ERROR(check_level(level, "momenta"));
    if (state.anchors.count(level) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("momenta has level ", level, " but anchors does not"));
    }
  }
  Restored restored;
  restored.outer = OuterLevel::FreshStates(plan);
  for (const auto& [level, anchor] : state.anchors) {
    auto m = state.momenta.find(level);
    MODELAVG_RETURN_IF_ERROR(
        restored.outer[level]->Load(anchor, m == state.momenta.end() ? nullptr : &m->second));
  }
  MODELAVG_RETURN_IF_ERROR(RestoreStreaming(state, &restored));
  return restored;
}

namespace {

std::vector<StateTensor> BufferTensors(OuterBuffer& buffer) {
  std::vector<StateTensor> out(buffer.size());
  for (size_t i = 0; i < buffer.size(); ++i) {
    out[i].dtype = buffer.dtype(i);
    out[i].numel = buffer.numel(i);
    const uint8_t* p = static_cast<const uint8_t*>(buffer.data(i));
    out[i].bytes.assign(p, p + buffer.nbytes(i));
  }
  return out;
}

}  // namespace

void Checkpoint::SaveStreaming(StreamingLevel& streaming, AveragerState* out) const {
  const FragmentStates& states = streaming.states();
  for (size_t level = 0; level < states.size(); ++level) {
    for (size_t f = 0; f < states[level].size(); ++f) {
      const OuterLevelState* state = states[level][f].get();
      if (state == nullptr || !state->has_anchor()) continue;
      FragmentState fs;
      fs.level = static_cast<int>(level);
      fs.fragment = static_cast<int>(f);
      fs.anchor = state->AnchorTensors();
      if (state->has_momentum()) fs.momentum = state->MomentumTensors();
      fs.residual = state->ResidualTensors();
      out->fragments.push_back(std::move(fs));
    }
  }
  for (const std::unique_ptr<PendingSync>& p : streaming.pending()) {
    // Its result is part of the state: wait for it, as the call at its apply step would.
    const absl::Duration bound = client_->options().collective_timeout + absl::Seconds(5);
    if (!p->done.WaitForNotificationWithTimeout(bound) && p->comm != nullptr) {
      p->comm->Abort(absl::DeadlineExceededError(absl::StrCat(
          "state_dict(): the background all-reduce of fragment ", p->decision.fragment,
          " started at step ", p->decision.step, " did not end within ",
          absl::FormatDuration(bound))));
      p->done.WaitForNotification();
    }
    if (p->thread.joinable()) p->thread.join();
    PendingState ps;
    ps.level = p->decision.level;
    ps.fragment = p->decision.fragment;
    ps.start_step = p->decision.step;
    ps.apply_step = p->apply_step;
    ps.first = p->first;
    if (p->result.ok() && p->device != nullptr) {
      absl::StatusOr<std::vector<StateTensor>> r = p->device->ResultTensors();
      if (r.ok()) ps.result = *std::move(r);
      if (!r.ok()) ps.error = r.status().ToString();
    } else if (p->result.ok()) {
      ps.result = BufferTensors(*p->buffer);
    } else {
      ps.error = p->result.ToString();
    }
    out->pending.push_back(std::move(ps));
  }
}

absl::Status Checkpoint::RestoreStreaming(const AveragerState& state, Restored* restored) const {
  FragmentStates* states = &restored->fragments;
  std::vector<std::unique_ptr<PendingSync>>* pending = &restored->pending;
  const std::vector<ScheduleLevel>& levels =
      client_->plans().At(std::max<int64_t>(0, state.step)).spec().levels;
  states->clear();
  states->resize(levels.size());
  for (size_t level = 0; level < levels.size(); ++level) {
    if (!StreamingOuterLevel(levels[level])) continue;
    for (int f = 0; f < std::max(1, levels[level].fragments); ++f) {
      (*states)[level].push_back(
          std::make_unique<OuterLevelState>(static_cast<int>(level), *levels[level].outer));
    }
  }
  auto check = [&](int level, int fragment, const std::string& what) -> absl::Status {
    if (level < 0 || level >= static_cast<int>(levels.size()) ||
        !StreamingOuterLevel(levels[level])) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " names level ", level, ", which is not a streaming outer level of job ",
          client_->job_id(), ": was the state_dict saved from another job's averager?"));
    }
    const int fragments = std::max(1, levels[level].fragments);
    if (fragment < 0 || fragment >= fragments) {
      return absl::InvalidArgumentError(absl::StrCat(what, " names fragment ", fragment,
                                                     " of level ", level, ", which has ",
                                                     fragments, " fragments"));
    }
    return absl::OkStatus();
  };
  for (const FragmentState& fs : state.fragments) {
    const std::string what = absl::StrCat("fragments[level ", fs.level, ", fragment ",
                                          fs.fragment, "]");
    MODELAVG_RETURN_IF_ERROR(check(fs.level, fs.fragment, what));
    OuterLevelState* s = (*states)[fs.level][fs.fragment].get();
    if (s->has_anchor()) {
      return absl::InvalidArgumentError(absl::StrCat(what, " appears twice"));
    }
    MODELAVG_RETURN_IF_ERROR(
        Annotate(s->Load(fs.anchor, fs.momentum.empty() ? nullptr : &fs.momentum), what));
    if (!fs.residual.empty() && levels[fs.level].error_feedback == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " has a residual but level ", fs.level,
          " has no error_feedback: was the state_dict saved from another job's averager?"));
    }
    MODELAVG_RETURN_IF_ERROR(Annotate(s->LoadResidual(fs.residual), what));
  }
  pending->clear();
  for (const PendingState& ps : state.pending) {
    const std::string what = absl::StrCat("pending[level ", ps.level, ", fragment ",
                                          ps.fragment, ", started at step ", ps.start_step, "]");
    MODELAVG_RETURN_IF_ERROR(check(ps.level, ps.fragment, what));
    const ScheduleLevel& spec = levels[ps.level];
    if (!ps.error.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, ": the background all-reduce had failed when the state was saved (", ps.error,
          "); resume from an earlier checkpoint"));
    }
    if (spec.sync_delay == 0 || ps.apply_step != ps.start_step + spec.sync_delay ||
        ps.apply_step < state.step || ps.start_step >= state.step) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": due at step ", ps.apply_step, " does not fit level ", ps.level,
          "'s sync_delay ", spec.sync_delay, " and the saved step ", state.step));
    }
    OuterLevelState* s = (*states)[ps.level][ps.fragment].get();
    if (ps.first == s->has_anchor()) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ps.first ? ": the fragment's first sync, but the fragment has an anchor"
                         : ": an outer step, but the fragment has no anchor"));
    }
    std::vector<TensorView> shape(ps.result.size());
    for (size_t i = 0; i < ps.result.size(); ++i) {
      const StateTensor& t = ps.result[i];
      if (t.dtype != DType::kFloat32 && t.dtype != DType::kFloat64) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": result tensor ", i, " is not float32 or float64"));
      }
      if (t.numel < 0 || t.bytes.size() != static_cast<size_t>(t.numel) * DTypeSize(t.dtype)) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": result tensor ", i, " has ",
                                                       t.bytes.size(), " bytes for ", t.numel,
                                                       " elements"));
      }
      shape[i].numel = t.numel;
      shape[i].dtype = t.dtype;
    }
    auto p = std::make_unique<PendingSync>();
    p->decision.step = ps.start_step;
    p->decision.average = true;
    p->decision.level = ps.level;
    p->decision.period = spec.period;
    p->decision.fragment = ps.fragment;
    p->decision.fragments = std::max(1, spec.fragments);
    p->decision.outer = true;
    p->apply_step = ps.apply_step;
    p->first = ps.first;
    p->state = s;
    p->buffer = std::make_unique<OuterBuffer>();
    p->buffer->Shape(shape);
    for (size_t i = 0; i < ps.result.size(); ++i) {
      if (!ps.result[i].bytes.empty()) {
        std::memcpy(p->buffer->data(i), ps.result[i].bytes.data(), ps.result[i].bytes.size());
      }
    }
    p->result = absl::OkStatus();
    p->done.Notify();
    pending->push_back(std::move(p));
  }
  return absl::OkStatus();
}

}  // namespace modelavg::client
