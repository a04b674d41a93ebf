// Text from clients shown to people (terminal tables, logs): control characters in it could
// retitle or clear a terminal, move its cursor or forge lines, and bidirectional overrides
// reorder what is shown. These find and escape them.
#ifndef MODELAVG_COMMON_PRINTABLE_H_
#define MODELAVG_COMMON_PRINTABLE_H_

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace modelavg {

// The offset of the first control character of `text` (C0: bytes 0x00-0x1f, DEL 0x7f, and C1:
// U+0080-U+009F, UTF-8 0xc2 0x80-0x9f) or bidirectional formatting character (U+061C,
// U+200E-U+200F, U+202A-U+202E, U+2066-U+2069: they reorder what is shown around them), or
// absl::string_view::npos when it has none.
size_t FindControlCharacter(absl::string_view text);

// `text` with each control character written as an escape: \n, \r, \t, \e (ESC), \xNN for the
// other bytes below 0x20 and DEL, \u0080-\u009f for C1, \u202e and the like for the
// bidirectional formatting characters; a backslash is doubled, so that the
// result reads back unambiguously. Everything else is kept as it is (UTF-8 included).
std::string EscapeControlCharacters(absl::string_view text);

}  // namespace modelavg

#endif  // MODELAVG_COMMON_PRINTABLE_H_
