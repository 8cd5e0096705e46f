// data/json_line.h against Python's json.loads (tests/oracles/json_lines.py), the reader Megatron's
// preprocess_data.py uses: for valid and malformed lines alike, the same verdict, the same message
// at the same position, and the same decoded "text" value.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "data/json_line.h"
#include "tests/python_oracle.h"

using namespace mt;

namespace {

const std::string kSource = MEGATRAIN_SOURCE_DIR;

std::string utf8_hex(const std::string& s) {
  std::string h;
  for (unsigned char c : s) h += fmt::format("{:02x}", c);
  return h;
}

// Our parser's verdict on one line, in the oracle's words.
std::string ours(const std::string& line) {
  JsonLineParser parser({"text"});
  std::vector<JsonField> fields;
  std::string error;
  if (!parser.parse(line, fields, error))
    return error.starts_with("the line is ") ? "NOTOBJ" : "ERR " + error;
  const JsonField& f = fields[0];
  switch (f.kind) {
    case JsonField::missing: return "OK missing";
    case JsonField::other: return "OK other";
    case JsonField::string: return "OK str:" + utf8_hex(f.strings.at(0));
    case JsonField::string_list: {
      std::string out = "OK list:";
      for (size_t i = 0; i < f.strings.size(); ++i) out += (i ? "," : "") + utf8_hex(f.strings[i]);
      return out;
    }
  }
  return "?";
}

// Valid lines of every shape, and lines broken at every place the parser checks a delimiter.
const std::vector<std::string> kLines = {
    R"({"text": "hello"})",
    R"({"text":"a\nb \u00e9 \ud83d\ude00 \"q\" \\ \/"})",
    R"({"a":1,"text":"x"})",
    R"({"text":["a","b"]})",
    R"({"text":[]})",
    R"({"text":[1,"a"]})",
    R"({"text":["a",[1]]})",
    R"({"text":null})",
    R"({"text":{"k":[1,2,{"z":null}]}})",
    R"({"text":"x","text":"y"})",
    R"({})",
    R"({"other":[true,false,null,NaN,Infinity,-Infinity,1.5e3,-0,0.25,1E-2]})",
    R"(  { "text" : "sp" , "b" : [ ] }  )",
    R"({"text":"lone \udc00 surrogate"})",
    R"({"t":{},"u":[[],[[]]],"text":"é"})",
    "",
    "{",
    R"({"text")",
    R"({"text":)",
    R"({"text" "x"})",
    R"({"text":"x",})",
    R"({"text":"x" "y"})",
    R"({,})",
    R"({"a":[1,2,]})",
    R"({"a":[1 2]})",
    R"({"a":[1,)",
    R"({"a":{"b":1 "c":2}})",
    R"({"a":{"b" 1}})",
    R"({"a":{,}})",
    R"({"text":["a" "b"]})",
    R"({"text":["a",]})",
    R"([1,2])",
    R"("str")",
    R"({"a":1} x)",
    R"({"a":tru})",
    R"({"a":01})",
    R"({"a":-})",
    R"({"a":1.})",
    R"({"a":"\x"})",
    "{\"a\":\"tab\there\"}",
    R"({'a':1})",
    R"({"a":1,"b"})",
    "\xEF\xBB\xBF{\"a\":1}",
    R"({"é ü":[1,}])",
    R"({"a":[{"b":[}]})",
    R"({"a":"unterminated})",
    R"({"a":"\u12"})",
};

}  // namespace

TEST_CASE("JSON lines: verdicts, messages and values match Python's json.loads", "[preprocess][oracle]") {
  const auto python = oracle::python_or_skip("json.loads oracle");
  if (!python) return;
  oracle::TempDir dir;
  {
    std::ofstream f(dir.file("lines.jsonl"), std::ios::binary);
    for (const std::string& l : kLines) f << l << '\n';
  }
  const std::string out = oracle::run_capture(oracle::shell_quote(*python) + " " +
                                              oracle::shell_quote(kSource + "/tests/oracles/json_lines.py") + " " +
                                              oracle::shell_quote(dir.file("lines.jsonl")));
  std::istringstream expected(out);
  std::string want;
  size_t n = 0, errors = 0;
  for (const std::string& l : kLines) {
    REQUIRE(std::getline(expected, want));
    INFO("line " << n << ": " << l);
    CHECK(ours(l + "\n") == want);
    errors += want.starts_with("ERR ");
    ++n;
  }
  CHECK(n == kLines.size());
  CHECK(errors >= 25);  // the battery exercises the error paths, not only valid lines
}
