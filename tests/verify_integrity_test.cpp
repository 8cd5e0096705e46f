// --verify-integrity (Megatron-LM's checkpoint integrity manifest): SHA-256 against FIPS 180-4's
// examples, the manifest written and checked file by file (Megatron's messages), the flag's rule
// (torch_dist only), and through the binary: a save writes integrity.json over every file of the
// iteration directory, a load with the flag checks it before reading anything, and a file changed
// on disk after the save is refused by name.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "checkpoint/checkpoint_io.h"
#include "core/error.h"
#include "core/sha256.h"
#include "tests/cli_test_util.h"
#include "training_binary_util.h"

using namespace mt;
using Catch::Contains;
namespace fs = std::filesystem;

namespace {
std::string sha(const std::string& s) {
  Sha256 h;
  h.update(s.data(), s.size());
  return h.hex_digest();
}
void write(const std::string& path, const std::string& content) {
  std::ofstream(path, std::ios::binary) << content;
}
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  FAIL_CHECK("expected an error");
  return "";
}
// Flips one bit of the byte at `offset` of the file.
void flip_byte(const std::string& path, std::streamoff offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  REQUIRE(f);
  f.seekg(offset);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x01);
  f.seekp(offset);
  f.write(&c, 1);
}
}  // namespace

TEST_CASE("sha256: FIPS 180-4 examples, in one piece and streamed", "[integrity]") {
  CHECK(sha("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(sha("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(sha("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq") ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // One million 'a', fed in pieces of uneven sizes that cross the 64-byte blocks.
  Sha256 h;
  const std::string a(1000, 'a');
  size_t left = 1000000, piece = 1;
  while (left > 0) {
    const size_t n = std::min({piece, left, a.size()});
    h.update(a.data(), n);
    left -= n;
    piece = piece * 3 + 1;
  }
  CHECK(h.hex_digest() == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  mt_test::TempDir dir;
  write(dir / "f", "abc");
  CHECK(sha256_file_hex(dir / "f") == sha("abc"));
}

TEST_CASE("integrity manifest: written over the directory's files, checked file by file", "[integrity]") {
  mt_test::TempDir dir;
  write(dir / "manifest.json", "{}");
  write(dir / "rank_00000-model.safetensors", std::string(3000, 'x'));
  write(dir / "rank_00001-model.safetensors", "abc");
  fs::create_directory(dir / "subdir");  // not a file: not listed (as Megatron's)
  save_integrity_manifest(dir.path());
  const nlohmann::json m = nlohmann::json::parse(mt_test::read_bytes(dir / kIntegrityManifestName));
  CHECK(m.at("algorithm") == "sha256");
  REQUIRE(m.at("files").size() == 3);
  CHECK(m["files"]["rank_00001-model.safetensors"] == sha("abc"));
  CHECK(m["files"]["manifest.json"] == sha("{}"));
  CHECK_FALSE(m["files"].contains(kIntegrityManifestName));
  CHECK(verify_integrity_manifest(dir.path()) == 3);

  // A changed file, by name, with both digests' beginnings (Megatron's message).
  flip_byte(dir / "rank_00000-model.safetensors", 1234);
  const std::string changed = error_of([&] { verify_integrity_manifest(dir.path()); });
  CHECK_THAT(changed, Contains("Checkpoint integrity verification failed for 1 file(s) in " + dir.path() + ":"));
  CHECK_THAT(changed, Contains("  rank_00000-model.safetensors: hash mismatch (expected " +
                               m["files"]["rank_00000-model.safetensors"].get<std::string>().substr(0, 16) + "..., got "));
  CHECK_THAT(changed, !Contains("rank_00001"));
  // A missing one too, and both counted.
  fs::remove(dir / "rank_00001-model.safetensors");
  const std::string missing = error_of([&] { verify_integrity_manifest(dir.path()); });
  CHECK_THAT(missing, Contains("failed for 2 file(s)"));
  CHECK_THAT(missing, Contains("  rank_00001-model.safetensors: file missing or unreadable ("));
  // Another algorithm, and no manifest at all.
  write(dir / kIntegrityManifestName, R"({"algorithm": "md5", "files": {}})");
  CHECK(error_of([&] { verify_integrity_manifest(dir.path()); }) ==
        "Unsupported hash algorithm in integrity manifest: 'md5'. Expected: 'sha256'.");
  fs::remove(dir / kIntegrityManifestName);
  CHECK_THAT(error_of([&] { verify_integrity_manifest(dir.path()); }),
             Contains("Integrity manifest not found at " + (dir / kIntegrityManifestName) +
                      ". The checkpoint must be saved with integrity verification enabled"));
}

TEST_CASE("cli: --verify-integrity", "[cli][integrity]") {
  using namespace mt::test;
  CHECK_FALSE(parse(small_gpt()).checkpoint.verify_integrity);
  CHECK(parse(small_gpt() + words("--verify-integrity")).checkpoint.verify_integrity);
  CHECK(parse(small_gpt() + words("--verify-integrity --ckpt-format torch_dist")).checkpoint.verify_integrity);
  // Megatron-LM's CheckpointConfig assertion, word for word.
  CHECK(parse_error(small_gpt() + words("--verify-integrity --ckpt-format torch")) ==
        "`verify_integrity` is only supported with torch_dist checkpoint format.");
}

TEST_CASE("flag --verify-integrity through the binary: saved, verified at load, a changed file refused by name",
          "[integrity][binary]") {
  using namespace mt_test::training_binary;
  mt_test::TempDir dir;
  const std::string save = dir / "ckpt", plain = dir / "plain";
  // (--lr-decay-iters: the resumed runs train longer on the same schedule.)
  const std::string run = kGpt + " --train-iters 4 --lr-decay-iters 8 --save-interval 2 --eval-iters 0";
  require_ok(megatrain(run + " --verify-integrity --save " + save));
  require_ok(megatrain(run + " --save " + plain));
  for (const char* it : {"iter_0000002", "iter_0000004"}) {
    const std::string d = save + "/" + it;
    INFO(d);
    REQUIRE(fs::exists(d + "/" + kIntegrityManifestName));
    const nlohmann::json m = nlohmann::json::parse(mt_test::read_bytes(d + "/" + kIntegrityManifestName));
    // Every other file of the directory, with its digest.
    size_t files = 0;
    for (const auto& e : fs::directory_iterator(d)) {
      const std::string name = e.path().filename();
      if (name == kIntegrityManifestName) continue;
      ++files;
      CHECK(m["files"].value(name, std::string()) == sha256_file_hex(e.path()));
    }
    CHECK(m["files"].contains("manifest.json"));
    CHECK(m["files"].size() == files);
  }
  CHECK_FALSE(fs::exists(plain + "/iter_0000004/" + kIntegrityManifestName));  // only with the flag

  // Resuming with the flag verifies first; without it, nothing is checked.
  const std::string resume = kGpt + " --train-iters 6 --lr-decay-iters 8 --override-opt-param-scheduler --eval-iters 0 --load " + save;
  const Result ok = megatrain(resume + " --verify-integrity");
  require_ok(ok);
  CHECK_THAT(ok.out, Contains("Checkpoint integrity verified: "));
  CHECK_THAT(ok.out, Contains(" file(s) OK in " + save + "/iter_0000004"));
  // A checkpoint saved without the manifest cannot be verified.
  const Result none = megatrain(kGpt + " --train-iters 6 --lr-decay-iters 8 --override-opt-param-scheduler --eval-iters 0 --verify-integrity --load " + plain);
  CHECK(none.code != 0);
  CHECK_THAT(none.out, Contains("error: Integrity manifest not found at " + plain + "/iter_0000004/integrity.json"));

  // One bit of a shard file changed after the save: refused, naming the file, before any tensor is
  // read (the per-slice checksums would only notice it when that slice is read).
  const std::string shard = "rank_00000-optim.safetensors";
  flip_byte(save + "/iter_0000004/" + shard, static_cast<std::streamoff>(fs::file_size(save + "/iter_0000004/" + shard) - 3));
  const Result bad = megatrain(resume + " --verify-integrity");
  INFO(bad.out);
  CHECK(bad.code != 0);
  CHECK_THAT(bad.out, Contains("error: Checkpoint integrity verification failed for 1 file(s) in " + save + "/iter_0000004:"));
  CHECK_THAT(bad.out, Contains("  " + shard + ": hash mismatch (expected "));
  CHECK_THAT(bad.out, !Contains("Checkpoint integrity verified"));
  // A changed manifest.json (which the per-slice checksums do not cover) likewise.
  const std::string manifest = save + "/iter_0000002/manifest.json";
  std::string text = mt_test::read_bytes(manifest);
  const size_t at = text.find("\"iteration\": 2");
  REQUIRE(at != std::string::npos);
  text.replace(at, 14, "\"iteration\": 3");
  write(manifest, text);
  const Result bad_manifest =
      megatrain(kGpt + " --train-iters 6 --lr-decay-iters 8 --override-opt-param-scheduler --eval-iters 0 --verify-integrity --ckpt-step 2 --load " + save);
  CHECK(bad_manifest.code != 0);
  CHECK_THAT(bad_manifest.out, Contains("  manifest.json: hash mismatch (expected "));
}
