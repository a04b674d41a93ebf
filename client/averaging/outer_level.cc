#include "client/averaging/outer_level.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/averaging/fragments.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {
namespace {

// The hand-over rounds' RoundOptions::layout_signature: their buffer has a layout of its own
// (the outer states), which the members agree on afresh in every such round, so that the
// communicator's agreed layout stays the parameters' (client/comm/round_agreement.h).
constexpr int64_t kHandOverSignature = 0x68616e646f766572;  // "handover"

// An outer state to hand over at an admission, with the parameter tensors it covers: a whole
// outer level all of them, a streaming level's fragment its run of tensors (docs/streaming.md).
struct StateHandOver {
  OuterLevelState* state;
  size_t first;
  size_t n;
  int fragment;  // -1: the whole level

  std::string Name() const {
    return fragment < 0 ? absl::StrCat("level ", state->level())
                        : absl::StrCat("level ", state->level(), " fragment ", fragment);
  }
  // Its tensors in the hand-over buffer: the anchor's, then with momentum the momentum's.
  size_t Width() const { return state->keeps_momentum() ? 2 * n : n; }
};

// Every outer state to hand over, for the parameters `all`: the whole levels of `outer`, and
// each fragment of a streaming level (its states in `fragment_outer`, made here if need be).
std::vector<StateHandOver> HandOvers(const std::vector<std::unique_ptr<OuterLevelState>>& outer,
                                     FragmentStates& fragment_outer,
                                     const std::vector<ScheduleLevel>& spec_levels,
                                     absl::Span<const TensorView> all) {
  std::vector<StateHandOver> out;
  for (const auto& state : outer) {
    if (state == nullptr) continue;
    const ScheduleLevel& l = spec_levels[state->level()];
    if (!StreamingOuterLevel(l)) {
      out.push_back({state.get(), 0, all.size(), -1});
      continue;
    }
    const int level = state->level();
    std::vector<std::unique_ptr<OuterLevelState>>& states = FragmentsOf(fragment_outer, level, l);
    const FragmentSplit split = SplitIntoFragments(all, std::max(1, l.fragments));
    for (int f = 0; f < static_cast<int>(states.size()); ++f) {
      out.push_back({states[f].get(), split.begin[f], split.begin[f + 1] - split.begin[f], f});
    }
  }
  return out;
}

// Each hand-over's donor to replacement `j`: the lowest contributing member of j's block at
// that hand-over's level, or -1 when there is none. The round's members all hold j's shard
// (sharded replicas), so the donor is always of the same shard of a live replica.
std::vector<int32_t> DonorsTo(int32_t j, const std::vector<StateHandOver>& hand_overs,
                              const Decision& decision,
                              const std::vector<ScheduleLevel>& spec_levels) {
  const std::vector<int32_t> members = decision.Members();
  std::vector<int32_t> donors;
  for (const StateHandOver& h : hand_overs) {
    const int32_t g = spec_levels[h.state->level()].group_size;
    int32_t donor = -1;
    for (int32_t m : members) {
      if (!std::binary_search(decision.joining.begin(), decision.joining.end(), m) &&
          m / g == j / g) {
        donor = m;
        break;
      }
    }
    donors.push_back(donor);
  }
  return donors;
}

// The hand-over buffer's tensors: a float64 header (per hand-over: anchor set, momentum set),
// then per hand-over its anchor and, with momentum, its momentum, in the state layout.
std::vector<TensorView> HandOverShape(const std::vector<StateHandOver>& hand_overs,
                                      const OuterBuffer& state_layout) {
  std::vector<TensorView> shape(1);
  shape[0].numel = static_cast<int64_t>(2 * hand_overs.size());
  shape[0].dtype = DType::kFloat64;
  for (const StateHandOver& h : hand_overs) {
    const int copies = h.state->keeps_momentum() ? 2 : 1;
    for (int c = 0; c < copies; ++c) {
      for (size_t i = h.first; i < h.first + h.n; ++i) {
        TensorView v;
        v.numel = state_layout.numel(i);
        v.dtype = state_layout.dtype(i);
        shape.push_back(v);
      }
    }
  }
  return shape;
}

// The donor's part of the buffer: the states this member (`me`) donates, with their header
// entries; everything else stays zero.
absl::Status WriteDonatedStates(const std::vector<StateHandOver>& hand_overs,
                                const std::vector<int32_t>& donors, int32_t me,
                                std::vector<TensorView>& views) {
  double* header = static_cast<double*>(views[0].data);
  size_t at = 1;
  for (size_t k = 0; k < hand_overs.size(); ++k) {
    OuterLevelState* level = hand_overs[k].state;
    const size_t n = hand_overs[k].n;
    if (donors[k] == me && level->has_anchor()) {
      MODELAVG_RETURN_IF_ERROR(level->CheckLayout(0, absl::MakeConstSpan(views).subspan(at, n)));
      header[2 * k] = 1;
      const std::vector<StateTensor> a = level->AnchorTensors();
      for (size_t i = 0; i < n; ++i) {
        if (!a[i].bytes.empty()) std::memcpy(views[at + i].data, a[i].bytes.data(), a[i].bytes.size());
      }
      if (level->has_momentum()) {
        header[2 * k + 1] = 1;
        const std::vector<StateTensor> m = level->MomentumTensors();
        for (size_t i = 0; i < n; ++i) {
          if (!m[i].bytes.empty()) {
            std::memcpy(views[at + n + i].data, m[i].bytes.data(), m[i].bytes.size());
          }
        }
      }
    }
    at += hand_overs[k].Width();
  }
  return absl::OkStatus();
}

// The replacement's side, once the round has run: loads every state the buffer holds.
absl::Status LoadHandedStates(const std::vector<StateHandOver>& hand_overs,
                              const std::vector<int32_t>& donors, const Decision& decision,
                              int32_t me, const std::vector<TensorView>& views) {
  const double* header = static_cast<const double*>(views[0].data);
  size_t at = 1;
  for (size_t k = 0; k < hand_overs.size(); ++k) {
    const StateHandOver& h = hand_overs[k];
    OuterLevelState* level = h.state;
    const size_t n = h.n;
    if (donors[k] < 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", me, " is admitted at step ", decision.step,
          " but no live member of its block at level ", level->level(),
          " takes part in the round to hand it that level's outer state; start the "
          "replacement again"));
    }
    if (header[2 * k] == 1) {
      auto copy = [&](size_t from) {
        std::vector<StateTensor> out(n);
        for (size_t i = 0; i < n; ++i) {
          out[i].dtype = views[from + i].dtype;
          out[i].numel = views[from + i].numel;
          const uint8_t* p = static_cast<const uint8_t*>(views[from + i].data);
          out[i].bytes.assign(p, p + views[from + i].nbytes());
        }
        return out;
      };
      const std::vector<StateTensor> a = copy(at);
      std::vector<StateTensor> m;
      if (header[2 * k + 1] == 1) m = copy(at + n);
      MODELAVG_RETURN_IF_ERROR(level->Load(a, header[2 * k + 1] == 1 ? &m : nullptr));
      spdlog::info("step {}: received the outer state of {} from rank {}", decision.step,
                   h.Name(), donors[k]);
    } else if (header[2 * k] != 0) {
      return absl::InternalError(absl::StrCat("outer state of ", h.Name(),
                                              " received from several members at once"));
    }
    at += h.Width();
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<std::unique_ptr<OuterLevelState>>& FragmentsOf(FragmentStates& states, int level,
                                                          const ScheduleLevel& spec) {
  if (states.size() <= static_cast<size_t>(level)) states.resize(level + 1);
  std::vector<std::unique_ptr<OuterLevelState>>& fragments = states[level];
  if (fragments.empty()) {
    for (int f = 0; f < std::max(1, spec.fragments); ++f) {
      fragments.push_back(std::make_unique<OuterLevelState>(level, *spec.outer));
    }
  }
  return fragments;
}

OuterLevel::OuterLevel(Client* client, OuterDevice* device, OuterBuffer* pseudo_gradient,
                       RoundRunner* rounds)
    : client_(client),
      device_(device),
      pseudo_gradient_(pseudo_gradient),
      rounds_(rounds),
      // A replacement admitted after a plan update starts with that plan's levels.
      states_(FreshStates(
          client->plans().At(std::max<int64_t>(0, client->admission_step())))) {}

std::vector<std::unique_ptr<OuterLevelState>> OuterLevel::FreshStates(const Schedule& schedule) {
  std::vector<std::unique_ptr<OuterLevelState>> states;
  const std::vector<ScheduleLevel>& levels = schedule.spec().levels;
  for (size_t i = 0; i < levels.size(); ++i) {
    states.push_back(levels[i].outer.has_value()
                         ? std::make_unique<OuterLevelState>(static_cast<int>(i), *levels[i].outer)
                         : nullptr);
  }
  return states;
}

bool OuterLevel::Has(int level) const {
  return level >= 0 && level < static_cast<int>(states_.size()) && states_[level] != nullptr;
}

namespace {

// A pseudo-gradient's round: named so in a non-finite report.
RoundWire GradientWire(RoundWire wire) {
  wire.contents = "pseudo-gradient";
  return wire;
}

}  // namespace

absl::StatusOr<Decision> OuterLevel::Round(const Decision& decision, const Device& device,
                                           absl::Span<const TensorView> params, RoundWire wire) {
  const int level = decision.level;
  const std::string where = absl::StrCat("outer step at step ", decision.step, " (level ", level,
                                         ", subgroup ", decision.subgroup.index, ")");
  OuterLevelState* state = Has(level) ? states_[level].get() : nullptr;
  if (state == nullptr) {
    return absl::InternalError(absl::StrCat(where, ": the coordinator's decision says outer but "
                                            "the job's spec has no outer optimizer at level ",
                                            level));
  }
  const ScheduleLevel& rule = client_->plans().Plan(decision.plan).spec().levels[level];
  if (rule.fragments > 1 || rule.sync_delay > 0 || rule.payload != Payload::kFp32) {
    // Not silently a whole-model fp32 outer step: the streaming fields change the rule.
    return absl::UnimplementedError(absl::StrCat(
        where, ": this client applies an outer level as a whole (fragments 1, sync_delay 0, "
               "payload FP32); level ", level, " asks for streaming sync (docs/streaming.md)"));
  }
  // A replacement at its admission step receives the outer state in the round (see
  // HandOver) and contributes no pseudo-gradient.
  const bool joining = std::binary_search(decision.joining.begin(), decision.joining.end(),
                                          client_->rank());
  const int64_t first = client_->plans().FirstStepOf(decision.plan, level);
  const bool first_step = first < 0 || decision.step == first;
  const auto no_anchor = [&] {
    // A later step without an anchor would mix a plain average into the group's outer step.
    return absl::FailedPreconditionError(absl::StrCat(
        where, ": this rank has no outer state for level ", level,
        " (its first averaging step was ", first,
        "): restore the averager with load_state_dict() from a checkpoint's state_dict() "
        "rather than set_step() alone"));
  };
  if (!device.is_host()) {
    // CUDA parameters (device_outer_state.h): the same rule, on the device.
    MODELAVG_ASSIGN_OR_RETURN(DeviceOuterState * on_device, device_->StateOf(state, device));
    if (!joining && !on_device->has_anchor() && !first_step) return no_anchor();
    Decision done = decision;
    absl::Status s = RunDeviceOuterStep(
        on_device, device_->gradient(), params, first_step, joining,
        [&](absl::Span<const TensorView> tensors, int64_t layout_signature) {
          // The pseudo-gradient's rounds agree on their own layout (device_outer_state.h).
          RoundWire own = wire;
          own.layout_signature ^= layout_signature;
          absl::StatusOr<Decision> r = rounds_->Run(decision, device, tensors, own);
          if (r.ok()) done = *r;
          return r.status();
        });
    if (!s.ok()) return Annotate(s, where);
    return done;
  }
  if (joining && !first_step) {
    pseudo_gradient_->Shape(params);
    std::vector<TensorView> d = pseudo_gradient_->Views();
    MODELAVG_ASSIGN_OR_RETURN(Decision done,
                              rounds_->Run(decision, device, d, GradientWire(wire)));
    MODELAVG_RETURN_IF_ERROR(Annotate(state->Step(0, d, params), where));
    return done;
  }
  if (!state->has_anchor()) {
    // The level's first averaging step: a plain average; the result is the anchor.
    if (!first_step) return no_anchor();
    MODELAVG_ASSIGN_OR_RETURN(Decision done, rounds_->Run(decision, device, params, wire));
    MODELAVG_RETURN_IF_ERROR(Annotate(state->SetAnchor(params), where));
    return done;
  }
  MODELAVG_RETURN_IF_ERROR(Annotate(state->CheckLayout(0, params), where));
  pseudo_gradient_->Shape(params);
  std::vector<TensorView> d = pseudo_gradient_->Views();
  MODELAVG_RETURN_IF_ERROR(Annotate(state->PseudoGradient(0, params, d), where));
  // The parameters and the state change only once the round has succeeded.
  MODELAVG_ASSIGN_OR_RETURN(Decision done,
                            rounds_->Run(decision, device, d, GradientWire(wire)));
  MODELAVG_RETURN_IF_ERROR(Annotate(state->Step(0, d, params), where));
  return done;
}

absl::Status OuterLevel::HandOver(const Decision& decision, Communicator* comm,
                                  absl::Span<const TensorView> all,
                                  absl::Span<const TensorView> layout,
                                  FragmentStates& fragments) {
  if (decision.joining.empty()) return absl::OkStatus();
  const std::vector<ScheduleLevel>& spec_levels =
      client_->plans().Plan(decision.plan).spec().levels;
  const std::vector<StateHandOver> hand_overs = HandOvers(states_, fragments, spec_levels, all);
  if (hand_overs.empty()) return absl::OkStatus();
  const int32_t me = client_->rank();
  OuterBuffer state_layout;
  state_layout.Shape(all);
  // One round per replacement: each hand-over's donor writes its part, everyone else zeros, and
  // the divisor is 1: an exact broadcast on the round's communicator.
  for (int32_t j : decision.joining) {
    const std::vector<int32_t> donors = DonorsTo(j, hand_overs, decision, spec_levels);
    OuterBuffer buffer;
    buffer.Shape(HandOverShape(hand_overs, state_layout));  // zeros
    std::vector<TensorView> views = buffer.Views();
    MODELAVG_RETURN_IF_ERROR(WriteDonatedStates(hand_overs, donors, me, views));
    RoundOptions options;
    options.step = decision.step;
    options.round = decision.round;
    options.contributors = 1;
    options.layout_signature = kHandOverSignature;
    // Checked like any round: a donor's NaN in its anchor or momentum is never adopted (the
    // replacement loads nothing, and the admission round fails naming the donor).
    options.check_finite = client_->options().check_finite;
    if (!layout.empty() && layout[0].device.is_cuda()) {
      // An NCCL round: the hand-over travels through a device copy of the buffer.
      MODELAVG_RETURN_IF_ERROR(device_->RoundThroughDevice(
          layout[0], views, buffer.total_bytes(), [&](absl::Span<const TensorView> on_device) {
            return comm->AllReduceAverage(on_device, options, nullptr);
          }));
    } else {
      MODELAVG_RETURN_IF_ERROR(comm->AllReduceAverage(views, options, nullptr));
    }
    if (j == me) {
      MODELAVG_RETURN_IF_ERROR(LoadHandedStates(hand_overs, donors, decision, me, views));
    }
  }
  return absl::OkStatus();
}

}  // namespace modelavg::client
