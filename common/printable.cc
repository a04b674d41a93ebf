#include "common/printable.h"

#include "absl/strings/str_format.h"

namespace modelavg {
namespace {

bool IsC0OrDel(unsigned char c) { return c < 0x20 || c == 0x7f; }

// A C1 control in UTF-8 starts at text[i]: 0xc2 followed by 0x80-0x9f.
bool IsC1At(absl::string_view text, size_t i) {
  return static_cast<unsigned char>(text[i]) == 0xc2 && i + 1 < text.size() &&
         static_cast<unsigned char>(text[i + 1]) >= 0x80 &&
         static_cast<unsigned char>(text[i + 1]) <= 0x9f;
}

}  // namespace

size_t FindControlCharacter(absl::string_view text) {
  for (size_t i = 0; i < text.size(); ++i) {
    if (IsC0OrDel(static_cast<unsigned char>(text[i])) || IsC1At(text, i)) return i;
  }
  return absl::string_view::npos;
}

std::string EscapeControlCharacters(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (IsC1At(text, i)) {
      absl::StrAppendFormat(&out, "\\u%04x", static_cast<unsigned char>(text[i + 1]));
      ++i;
      continue;
    }
    switch (c) {
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case 0x1b: out += "\\e"; break;
      default:
        if (IsC0OrDel(c)) {
          absl::StrAppendFormat(&out, "\\x%02x", c);
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out;
}

}  // namespace modelavg
