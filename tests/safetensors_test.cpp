// safetensors reader/writer: format rules, round trip, and byte-level compatibility with Python's
// `safetensors` package in both directions.
#include <catch2/catch.hpp>
#include <cstring>
#include <vector>

#include "checkpoint/safetensors.h"
#include "ckpt_test_util.h"
#include "core/crc32c.h"
#include "core/error.h"
#include "tests/skip.h"

using namespace mt;
using mt_test::TempDir;

namespace {

std::vector<uint16_t> bf16_values(int n) {
  std::vector<uint16_t> v(n);
  for (int i = 0; i < n; ++i) v[i] = float_to_bf16_bits(0.5f * i - 3.25f);
  return v;
}

uint64_t header_length(const std::string& bytes) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  return n;
}

}  // namespace

TEST_CASE("crc32c matches the standard check value and the table path", "[checkpoint][crc32c]") {
  const char* s = "123456789";
  CHECK(crc32c(s, 9) == 0xE3069283u);
  CHECK(crc32c_extend_portable(0, s, 9) == 0xE3069283u);
  // Extension equals one pass; odd lengths exercise the byte tails.
  std::vector<unsigned char> data(1000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 131 + 7);
  for (size_t split : {0, 1, 7, 8, 13, 999}) {
    const uint32_t a = crc32c_extend(crc32c(data.data(), split), data.data() + split, data.size() - split);
    CHECK(a == crc32c(data.data(), data.size()));
    CHECK(crc32c_extend_portable(0, data.data(), data.size()) == crc32c(data.data(), data.size()));
  }
  // TFRecord's masked CRC of an 8-byte length 0x18 (TensorFlow's golden record: a37f4b22, little-endian).
  const unsigned char len[8] = {0x18, 0, 0, 0, 0, 0, 0, 0};
  CHECK(crc32c_mask(crc32c(len, 8)) == 0x224b7fa3u);
}

TEST_CASE("safetensors header matches the format's example byte for byte", "[checkpoint][safetensors]") {
  TempDir dir;
  std::vector<uint16_t> w = {0, 1, 2, 3};
  SafetensorsWriter writer(dir / "a.safetensors");
  writer.set_metadata("format", "pt");
  writer.add("w", DType::bf16, {2, 2}, w.data());
  CHECK(writer.header_json() == R"({"__metadata__":{"format":"pt"},"w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}})");
  writer.finish();
  const std::string bytes = mt_test::read_bytes(dir / "a.safetensors");
  REQUIRE(bytes.size() == 8 + 88 + 8);
  CHECK(bytes.substr(0, 8) == std::string("\x58\0\0\0\0\0\0\0", 8));
}

TEST_CASE("safetensors round trip of every dtype, scalars and empty tensors", "[checkpoint][safetensors]") {
  TempDir dir;
  const std::string path = dir / "t.safetensors";
  std::vector<float> f32 = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, -8.5f};
  std::vector<double> f64 = {1e300, -2.5};
  std::vector<uint16_t> bf = bf16_values(5);
  std::vector<uint16_t> f16 = {float_to_f16_bits(0.5f), float_to_f16_bits(-65504.0f), float_to_f16_bits(1e-7f)};
  std::vector<int32_t> i32 = {-1, 2147483647, 0};
  std::vector<int64_t> i64 = {int64_t{1} << 40, -3};
  std::vector<uint8_t> u8 = {0, 255, 17};
  float scalar = 42.0f;

  SafetensorsWriter w(path);
  w.set_metadata("format", "pt");
  w.set_metadata("note", "quote \" and unicode \xc3\xa9");
  w.add("f32", DType::f32, {2, 3}, f32.data());
  w.add("f64", DType::f64, {2}, f64.data());
  w.add("bf16", DType::bf16, {5}, bf.data());
  w.add("f16", DType::f16, {1, 3}, f16.data());
  w.add("i32", DType::i32, {3}, i32.data());
  w.add("i64", DType::i64, {2, 1}, i64.data());
  w.add("u8", DType::u8, {3}, u8.data());
  w.add("scalar", DType::f32, {}, &scalar);
  w.add("empty", DType::f32, {0, 3}, nullptr);
  const auto written = w.finish();
  REQUIRE(written.size() == 9);
  for (const auto& x : written) {
    if (x.name == "f32") CHECK(x.crc32c == crc32c(f32.data(), 24));
  }

  SafetensorsFile f(path);
  CHECK(f.metadata().at("format") == "pt");
  CHECK(f.metadata().at("note") == "quote \" and unicode \xc3\xa9");
  CHECK(f.entries().size() == 9);
  const std::string bytes = mt_test::read_bytes(path);
  CHECK((8 + header_length(bytes)) % 8 == 0);
  // Every tensor starts aligned to its element size.
  for (const auto& e : f.entries())
    if (e.dtype) CHECK(e.begin % dtype_size(*e.dtype) == 0);
  CHECK(std::memcmp(f.get("f32").data, f32.data(), 24) == 0);
  CHECK(f.get("f32").shape == std::vector<int64_t>{2, 3});
  CHECK(std::memcmp(f.get("f64").data, f64.data(), 16) == 0);
  CHECK(std::memcmp(f.get("bf16").data, bf.data(), 10) == 0);
  CHECK(std::memcmp(f.get("f16").data, f16.data(), 6) == 0);
  CHECK(std::memcmp(f.get("i32").data, i32.data(), 12) == 0);
  CHECK(std::memcmp(f.get("i64").data, i64.data(), 16) == 0);
  CHECK(std::memcmp(f.get("u8").data, u8.data(), 3) == 0);
  CHECK(f.get("scalar").shape.empty());
  CHECK(f.get("scalar").numel() == 1);
  CHECK(*reinterpret_cast<const float*>(f.get("scalar").data) == 42.0f);
  CHECK(f.get("empty").nbytes() == 0);
  CHECK(f.get("i64").dtype == DType::i64);
  const Tensor v = f.view("f32");
  CHECK(v.ndim == 2);
  CHECK(v.ptr<float>()[5] == -8.5f);
  CHECK_THROWS_WITH(f.get("nope"), Catch::Contains("no tensor named 'nope'"));
}

TEST_CASE("safetensors reader refuses malformed files naming the file", "[checkpoint][safetensors]") {
  TempDir dir;
  const std::string good = dir / "good.safetensors";
  std::vector<float> data(16, 1.0f);
  {
    SafetensorsWriter w(good);
    w.add("a", DType::f32, {4, 4}, data.data());
    w.finish();
  }
  const std::string bytes = mt_test::read_bytes(good);

  SECTION("truncated data") {
    const std::string p = dir / "trunc.safetensors";
    mt_test::write_text(p, bytes.substr(0, bytes.size() - 5));
    CHECK_THROWS_WITH(SafetensorsFile(p), Catch::Contains(p) && Catch::Contains("truncated"));
  }
  SECTION("truncated header") {
    const std::string p = dir / "trunc_header.safetensors";
    mt_test::write_text(p, bytes.substr(0, 20));
    CHECK_THROWS_WITH(SafetensorsFile(p), Catch::Contains(p) && Catch::Contains("truncated"));
  }
  SECTION("shorter than the length field") {
    const std::string p = dir / "tiny.safetensors";
    mt_test::write_text(p, "abc");
    CHECK_THROWS_WITH(SafetensorsFile(p), Catch::Contains(p));
  }
  SECTION("trailing bytes") {
    const std::string p = dir / "trailing.safetensors";
    mt_test::write_text(p, bytes + "xx");
    CHECK_THROWS_WITH(SafetensorsFile(p), Catch::Contains("after the last tensor"));
  }
  SECTION("bad JSON") {
    std::string b = bytes;
    b[8 + 3] = '!';
    const std::string p = dir / "json.safetensors";
    mt_test::write_text(p, b);
    CHECK_THROWS_WITH(SafetensorsFile(p), Catch::Contains(p));
  }
  SECTION("size and shape disagree") {
    const std::string header = R"({"a":{"dtype":"F32","shape":[4,3],"data_offsets":[0,64]}})";
    std::string b(8, '\0');
    b[0] = static_cast<char>(header.size());
    b += header + std::string(64, '\0');
    const std::string p = dir / "shape.safetensors";
    mt_test::write_text(p, b);
    CHECK_THROWS_WITH(SafetensorsFile(p), Catch::Contains("needs 48 bytes"));
  }
  SECTION("hole between tensors") {
    const std::string header =
        R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}})";
    std::string b(8, '\0');
    b[0] = static_cast<char>(header.size());
    b += header + std::string(6, '\0');
    const std::string p = dir / "hole.safetensors";
    mt_test::write_text(p, b);
    CHECK_THROWS_WITH(SafetensorsFile(p), Catch::Contains("hole"));
  }
  SECTION("duplicate name") {
    const std::string header =
        R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})";
    std::string b(8, '\0');
    b[0] = static_cast<char>(header.size());
    b += header + std::string(4, '\0');
    const std::string p = dir / "dup.safetensors";
    mt_test::write_text(p, b);
    CHECK_THROWS_WITH(SafetensorsFile(p), Catch::Contains("names 'a' twice"));
  }
  SECTION("missing file") {
    CHECK_THROWS_WITH(SafetensorsFile(dir / "absent.safetensors"), Catch::Contains("absent.safetensors"));
  }
}

TEST_CASE("safetensors files are byte-identical to Python's and load both ways", "[checkpoint][safetensors][python]") {
  std::string why;
  const auto py = mt_test::find_test_python("safetensors numpy", &why);
  if (!py) {
    MT_SKIP("safetensors Python compatibility: " << why);
  }
  TempDir dir;
  std::vector<float> f32 = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, -8.5f};
  std::vector<double> f64 = {1e300, -2.5};
  std::vector<uint16_t> bf = bf16_values(5);
  std::vector<uint16_t> f16 = {float_to_f16_bits(0.5f), float_to_f16_bits(-1.0f), float_to_f16_bits(3.0f)};
  std::vector<int32_t> i32 = {-1, 2147483647, 0};
  std::vector<int64_t> i64 = {int64_t{1} << 40, -3};
  std::vector<uint8_t> u8 = {0, 255, 17};

  // C++ -> file; the Python script rebuilds the same tensors and serializes them with the reference
  // implementation, checks that it can load ours, and writes its own file for us to compare and load.
  const std::string ours = dir / "ours.safetensors";
  {
    SafetensorsWriter w(ours);
    w.set_metadata("format", "pt");
    w.add("layer.f32", DType::f32, {2, 3}, f32.data());
    w.add("f64", DType::f64, {2}, f64.data());
    w.add("b.bf16", DType::bf16, {5}, bf.data());
    w.add("a.f16", DType::f16, {1, 3}, f16.data());
    w.add("i32", DType::i32, {3}, i32.data());
    w.add("i64", DType::i64, {2, 1}, i64.data());
    w.add("u8", DType::u8, {3}, u8.data());
    w.finish();
  }
  const std::string script = dir / "check.py";
  mt_test::write_text(script, R"PY(
import sys, numpy as np
from safetensors import TensorSpec, serialize_file, deserialize, safe_open
ours, theirs = sys.argv[1], sys.argv[2]
def bf16(x):
    b = np.asarray(x, dtype=np.float32).view(np.uint32)
    b = b + 0x7fff + ((b >> 16) & 1)
    return (b >> 16).astype(np.uint16)
arrays = {
  "layer.f32": ("float32", np.array([[1.5, -2.0, 3.25], [0.0, 7.0, -8.5]], dtype=np.float32)),
  "f64": ("float64", np.array([1e300, -2.5], dtype=np.float64)),
  "b.bf16": ("bfloat16", bf16([0.5 * i - 3.25 for i in range(5)])),
  "a.f16": ("float16", np.array([[0.5, -1.0, 3.0]], dtype=np.float16)),
  "i32": ("int32", np.array([-1, 2147483647, 0], dtype=np.int32)),
  "i64": ("int64", np.array([[1 << 40], [-3]], dtype=np.int64)),
  "u8": ("uint8", np.array([0, 255, 17], dtype=np.uint8)),
}
# numpy-typed tensors through the public loader (numpy has no bfloat16)
with safe_open(ours, framework="np") as f:
    assert f.metadata() == {"format": "pt"}
    assert sorted(f.keys()) == sorted(arrays)
    for name, (dt, a) in arrays.items():
        if dt == "bfloat16":
            continue
        t = f.get_tensor(name)
        assert t.dtype == a.dtype and t.shape == a.shape, name
        assert np.array_equal(t, a), name
# every tensor (bf16 included) through the raw deserializer
raw = dict(deserialize(open(ours, "rb").read()))
for name, (dt, a) in arrays.items():
    assert bytes(raw[name]["data"]) == a.tobytes(), name
    assert list(raw[name]["shape"]) == list(a.shape) or (name == "b.bf16" and raw[name]["shape"] == [5]), name
specs = {}
for name, (dt, a) in arrays.items():
    a = np.ascontiguousarray(a)
    specs[name] = TensorSpec(dtype=dt, shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes)
serialize_file(specs, theirs, metadata={"format": "pt"})
print("ok")
)PY");
  const std::string theirs = dir / "theirs.safetensors";
  std::string out;
  const int rc = mt_test::run_command(*py + " " + script + " " + ours + " " + theirs, &out);
  INFO(out);
  REQUIRE(rc == 0);
  // The reference serializer's file is byte-identical to ours (same order, padding, header).
  CHECK(mt_test::read_bytes(theirs) == mt_test::read_bytes(ours));
  SafetensorsFile f(theirs);
  CHECK(std::memcmp(f.get("b.bf16").data, bf.data(), 10) == 0);
  CHECK(std::memcmp(f.get("i64").data, i64.data(), 16) == 0);
  CHECK(f.get("a.f16").shape == std::vector<int64_t>{1, 3});
}
