// Escaping control characters for terminals and logs (common/printable.h), against a naive
// restatement of the rule: every byte below 0x20, 0x7f and every C1 code point (U+0080-U+009F)
// is written as an escape, the rest is kept.
#include "common/printable.h"

#include <cstdint>
#include <string>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"

namespace modelavg {
namespace {

TEST(PrintableTest, EscapeControlCharacters_EachKind) {
  EXPECT_EQ(EscapeControlCharacters("plain host-7:42"), "plain host-7:42");
  EXPECT_EQ(EscapeControlCharacters("\x1b]0;x\x07"), "\\e]0;x\\x07");
  EXPECT_EQ(EscapeControlCharacters("a\r\nb\tc"), "a\\r\\nb\\tc");
  EXPECT_EQ(EscapeControlCharacters(std::string("a\0b", 3)), "a\\x00b");
  EXPECT_EQ(EscapeControlCharacters("del\x7f"), "del\\x7f");
  EXPECT_EQ(EscapeControlCharacters("csi\xc2\x9b" "31m"), "csi\\u009b31m");
  // Other UTF-8 stays, a backslash is doubled (so "\\e" typed by someone is not ESC).
  EXPECT_EQ(EscapeControlCharacters("\xc3\xa9t\xc3\xa9 \xc2\xa0"), "\xc3\xa9t\xc3\xa9 \xc2\xa0");
  EXPECT_EQ(EscapeControlCharacters("a\\e"), "a\\\\e");
}

// Every single byte and every two-byte sequence 0xc2 xx: the result has no control character
// and FindControlCharacter agrees with the naive rule.
TEST(PrintableTest, EveryByte_NoControlCharacterLeft) {
  for (int b = 0; b < 256; ++b) {
    const std::string one(1, static_cast<char>(b));
    const bool control = b < 0x20 || b == 0x7f;
    EXPECT_EQ(FindControlCharacter(one) == 0, control) << b;
    EXPECT_EQ(FindControlCharacter(EscapeControlCharacters(one)), absl::string_view::npos) << b;
    const std::string two = std::string("\xc2") + static_cast<char>(b);
    const bool c1 = b >= 0x80 && b <= 0x9f;
    EXPECT_EQ(FindControlCharacter(two) != absl::string_view::npos, c1 || control) << b;
    EXPECT_EQ(FindControlCharacter(EscapeControlCharacters(two)), absl::string_view::npos) << b;
    if (c1) EXPECT_EQ(EscapeControlCharacters(two), absl::StrFormat("\\u%04x", b));
  }
}

// A right-to-left override in a worker id made "gpj.exe" read "exe.jpg" in the CLI. Every
// bidirectional formatting character is found and escaped; its neighbours in those blocks stay.
TEST(PrintableTest, BidirectionalFormattingCharacters_FoundAndEscaped) {
  EXPECT_EQ(EscapeControlCharacters("w\xe2\x80\xaegpj.exe"), "w\\u202egpj.exe");
  EXPECT_EQ(FindControlCharacter("w\xe2\x80\xaegpj.exe"), 1u);
  EXPECT_EQ(EscapeControlCharacters("\xd8\x9c" "a"), "\\u061ca");
  auto utf8 = [](uint32_t cp) {
    std::string s;
    if (cp < 0x800) {
      s += static_cast<char>(0xc0 | (cp >> 6));
    } else {
      s += static_cast<char>(0xe0 | (cp >> 12));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    }
    s += static_cast<char>(0x80 | (cp & 0x3f));
    return s;
  };
  for (uint32_t cp = 0x600; cp < 0x2100; ++cp) {
    const bool bidi = cp == 0x061c || cp == 0x200e || cp == 0x200f ||
                      (cp >= 0x202a && cp <= 0x202e) || (cp >= 0x2066 && cp <= 0x2069);
    const std::string one = utf8(cp);
    EXPECT_EQ(FindControlCharacter(one) == 0, bidi) << std::hex << cp;
    EXPECT_EQ(FindControlCharacter(EscapeControlCharacters(one)), absl::string_view::npos)
        << std::hex << cp;
    EXPECT_EQ(EscapeControlCharacters(one), bidi ? absl::StrFormat("\\u%04x", cp) : one)
        << std::hex << cp;
  }
}

}  // namespace
}  // namespace modelavg
