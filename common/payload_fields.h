// The level fields a payload needs (include/modelavg/common/payload.h's rows), checked once for
// the coordinator's spec validation (schedule.cc) and for Python's modelavg.Level (the binding),
// each naming the fields its own way.
#ifndef MODELAVG_COMMON_PAYLOAD_FIELDS_H_
#define MODELAVG_COMMON_PAYLOAD_FIELDS_H_

#include <functional>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "modelavg/common/payload.h"

namespace modelavg {

// How a message names a level's field and its value: "levels[0].topk_density 0.1" in the
// coordinator's, "Level(period=8, group_size=4): topk_density=0.1" in Python's.
using FieldText = std::function<std::string(absl::string_view field, double value)>;

// INVALID_ARGUMENT naming the field when `topk_density` does not fit `payload` (in (0, 1) for
// a top-k payload, 0 for the others) or, with `outer`, when `error_feedback` is not 0 and the
// payload loses nothing. The ranges of the fields themselves are the caller's.
absl::Status CheckPayloadFields(Payload payload, double topk_density, double error_feedback,
                                bool outer, const FieldText& field);

// The payload named `name` (exactly as kPayloads spells it), or nullopt.
std::optional<Payload> PayloadNamed(absl::string_view name);

// The names of the payloads `keep` keeps, as a list: "BF16, INT8, INT4 or TOPK".
std::string PayloadNameList(const std::function<bool(const PayloadInfo&)>& keep);

}  // namespace modelavg

#endif  // MODELAVG_COMMON_PAYLOAD_FIELDS_H_
