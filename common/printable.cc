#include "common/printable.h"

#include <cstdint>

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

// A bidirectional formatting character starts at text[i] (UTF-8): ALM U+061C, LRM and RLM
// U+200E-U+200F, the embeddings and overrides U+202A-U+202E, the isolates U+2066-U+2069. They
// reorder what a terminal or a page shows (U+202E turns "exe.txt" into what looks like
// "txt.exe"). Its code point, or 0.
uint32_t BidiAt(absl::string_view text, size_t i) {
  const auto at = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  if (i + 1 < text.size() && at(i) == 0xd8 && at(i + 1) == 0x9c) return 0x061c;
  if (i + 2 >= text.size() || at(i) != 0xe2) return 0;
  const uint32_t cp = ((at(i) & 0x0fu) << 12) | ((at(i + 1) & 0x3fu) << 6) | (at(i + 2) & 0x3fu);
  if ((at(i + 1) & 0xc0) != 0x80 || (at(i + 2) & 0xc0) != 0x80) return 0;
  if (cp == 0x200e || cp == 0x200f || (cp >= 0x202a && cp <= 0x202e) ||
      (cp >= 0x2066 && cp <= 0x2069)) {
    return cp;
  }
  return 0;
}

}  // namespace

size_t FindControlCharacter(absl::string_view text) {
  for (size_t i = 0; i < text.size(); ++i) {
    if (IsC0OrDel(static_cast<unsigned char>(text[i])) || IsC1At(text, i) ||
        BidiAt(text, i) != 0) {
      return i;
    }
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
    if (const uint32_t cp = BidiAt(text, i); cp != 0) {
      absl::StrAppendFormat(&out, "\\u%04x", cp);
      i += cp == 0x061c ? 1 : 2;
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
