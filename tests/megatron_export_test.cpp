// export-megatron: megatrain checkpoints as Megatron-LM checkpoints (torch_dist, the default, and the
// torch format). The writers
// (pickles, torch.save archives, Megatron's start-up RNG states) against what Python, torch.save
// and Megatron-LM wrote (tests/fixtures/megatron); training state through a round trip (megatrain
// trains, exports in another layout, import-megatron reads it back: every tensor and counter
// the same); Megatron-LM's own checkpoints through import + export (the same files back).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include "app/export_megatron.h"
#include "app/import_megatron.h"
#include "checkpoint/checkpoint_io.h"
#include "checkpoint/dcp_writer.h"
#include "checkpoint/megatron_checkpoint.h"
#include "checkpoint/megatron_names.h"
#include "checkpoint/megatron_rng.h"
#include "checkpoint/pickle_writer.h"
#include "checkpoint/torch_file.h"
#include "checkpoint/torch_writer.h"
#include "ckpt_compare.h"
#include "ckpt_test_util.h"
#include "core/error.h"
#include "python_oracle.h"
#include "skip.h"

using mt_test::losses_and_norms;
using mt_test::read_whole;
using mt_test::require_same_state;
using mt_test::same;
using mt_test::read_bytes;
using mt_test::run_command;
using mt_test::TempDir;
namespace fs = std::filesystem;

namespace {

const std::string kFixtures = "tests/fixtures/megatron";

const std::string kCommon =
    "--device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 60 --make-vocab-size-divisible-by 32 "
    "--seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --min-lr 1e-4 "
    "--lr-decay-style cosine --lr-warmup-iters 1 --weight-decay 0.01 --attention-dropout 0 --hidden-dropout 0 "
    "--seed 1234 --log-interval 1 --eval-iters 0 --eval-interval 1000";
const std::string kLlama =
    "--num-layers 4 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --group-query-attention "
    "--num-query-groups 2 --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
    "--untie-embeddings-and-output-weights --qk-layernorm";
const std::string kGpt = "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --position-embedding-type learned_absolute";
const std::string kLlamaSinks = kLlama + " --softmax-type learnable";  // a parameter per head, split over TP
// Sigmoid routing with the expert bias (a router buffer).
const std::string kMoe = kLlama + " --num-experts 4 --moe-router-topk 2 --moe-router-score-function sigmoid "
                                  "--moe-router-enable-expert-bias --moe-grouped-gemm";

const mt::PickleValue& at(const mt::PickleValue& v, const std::string& key) { return v.at(key, "test"); }

const mt::PickleValue* int_entry(const mt::PickleValue& dict, int64_t key) {
  for (const auto& [k, v] : dict.entries)
    if (k->is(mt::PickleKind::integer) && k->integer == key) return v.get();
  return nullptr;
}

// Trains `model` for 3 iterations on the CPU and saves.
std::string train(const TempDir& tmp, const std::string& model, const std::string& extra = "") {
  const std::string dir = tmp / "megatrain";
  std::string out;
  const int code = run_command(std::string(MEGATRAIN_BINARY) + " " + kCommon + " " + model + " " + extra +
                                   " --train-iters 3 --save " + dir + " --save-interval 3",
                               &out);
  INFO(out);
  REQUIRE(code == 0);
  return dir;
}

}  // namespace

TEST_CASE("the pickle writer writes what the pickle reader reads", "[megatron-export]") {
  mt::PickleRef root = mt::pickle_dict();
  mt::pickle_set(*root, "ints",
                 mt::pickle_list({mt::pickle_int(0), mt::pickle_int(255), mt::pickle_int(256), mt::pickle_int(65536),
                                  mt::pickle_int(-1), mt::pickle_int(INT32_MIN), mt::pickle_int(1LL << 40),
                                  mt::pickle_int(-(1LL << 40)), mt::pickle_int(INT64_MAX), mt::pickle_int(INT64_MIN),
                                  mt::pickle_int(128), mt::pickle_int(-129), mt::pickle_int(2147483648LL)}));
  mt::pickle_set(*root, "floats", mt::pickle_tuple({mt::pickle_float(1.5), mt::pickle_float(-0.0), mt::pickle_float(1e-300)}));
  mt::pickle_set(*root, "flags", mt::pickle_tuple({mt::pickle_bool(true), mt::pickle_bool(false), mt::pickle_none()}));
  mt::pickle_set(*root, "raw", mt::pickle_bytes(std::string("\x00\x80\xff", 3)));
  mt::pickle_set(*root, "text", mt::pickle_str("h\xc3\xa9llo \xe4\xb8\x96"));
  mt::PickleRef od = mt::pickle_ordered_dict();
  mt::pickle_set(*od, "b", mt::pickle_tuple({mt::pickle_int(1), mt::pickle_int(2), mt::pickle_int(3), mt::pickle_int(4)}));
  mt::pickle_set(*od, "a", mt::pickle_list());
  mt::pickle_set(*root, "ordered", od);
  mt::pickle_set(*root, mt::pickle_int(7), mt::pickle_global("torch.float32"));
  mt::PickleRef ns = mt::pickle_object("argparse.Namespace", {}, mt::pickle_dict());
  mt::pickle_set(*ns->state, "num_layers", mt::pickle_int(4));
  mt::pickle_set(*root, "args", ns);
  const std::string bytes = mt::write_pickle(*root);
  CHECK(bytes.substr(0, 2) == "\x80\x02");  // protocol 2, as torch.save
  const mt::PickleRef back = mt::read_pickle(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), "w");
  std::vector<int64_t> ints;
  for (const auto& i : at(*back, "ints").items) ints.push_back(i->integer);
  CHECK(ints == std::vector<int64_t>{0, 255, 256, 65536, -1, INT32_MIN, 1LL << 40, -(1LL << 40), INT64_MAX, INT64_MIN, 128,
                                     -129, 2147483648LL});
  const mt::PickleValue& floats = at(*back, "floats");
  REQUIRE(floats.items.size() == 3);
  CHECK(floats.items[0]->floating == 1.5);
  CHECK(std::signbit(floats.items[1]->floating));
  CHECK(floats.items[2]->floating == 1e-300);
  CHECK(at(*back, "flags").items[0]->boolean);
  CHECK(at(*back, "flags").items[2]->is(mt::PickleKind::none));
  CHECK(at(*back, "raw").is(mt::PickleKind::bytes));
  CHECK(at(*back, "raw").text == std::string("\x00\x80\xff", 3));
  CHECK(at(*back, "text").text == "h\xc3\xa9llo \xe4\xb8\x96");
  const mt::PickleValue& ordered = at(*back, "ordered");  // OrderedDict(): a dict, in order
  REQUIRE(ordered.entries.size() == 2);
  CHECK(ordered.entries[0].first->text == "b");
  CHECK(ordered.entries[0].second->items.size() == 4);
  CHECK(int_entry(*back, 7)->is(mt::PickleKind::global));
  CHECK(int_entry(*back, 7)->text == "torch.float32");
  CHECK(at(*back, "args").is_object("argparse.Namespace"));
  CHECK(at(at(*back, "args"), "num_layers").integer == 4);
}

TEST_CASE("torch.save archives written without PyTorch read back, aligned, with zip64 records", "[megatron-export]") {
  CHECK(mt::crc32_zip("123456789", 9) == 0xCBF43926u);
  CHECK(mt::crc32_zip("", 0) == 0);
  std::string long_text(1000, 'x');
  for (size_t i = 0; i < long_text.size(); ++i) long_text[i] = static_cast<char>(i * 7);
  CHECK(mt::crc32_zip(long_text.data(), 1000) ==
        mt::crc32_zip(long_text.data() + 3, 997, mt::crc32_zip(long_text.data(), 3)));
  TempDir tmp;
  for (const bool zip64 : {false, true}) {
    INFO("zip64 " << zip64);
    mt::TorchSaveWriter w;
    if (zip64) w.set_zip64_threshold(1);
    mt::HostArray m = mt::HostArray::zeros(mt::DType::f32, {2, 3});
    for (int i = 0; i < 6; ++i) m.ptr<float>()[i] = 0.5f * static_cast<float>(i) - 1;
    mt::HostArray s = mt::HostArray::zeros(mt::DType::f32, {});
    s.ptr<float>()[0] = 3;
    mt::PickleRef root = mt::pickle_dict();
    mt::pickle_set(*root, "m", w.tensor(m));
    mt::pickle_set(*root, "s", w.tensor(s));
    int produced = 0;
    mt::pickle_set(*root, "lazy", w.tensor(mt::DType::bf16, {5}, [&produced]() {
      ++produced;
      mt::HostArray b = mt::HostArray::zeros(mt::DType::bf16, {5});
      for (int i = 0; i < 5; ++i) b.ptr<uint16_t>()[i] = static_cast<uint16_t>(0x3f80 + i);
      return b;
    }));
    CHECK(produced == 0);  // made when written
    const std::string path = tmp / (zip64 ? "z64.pt" : "plain.pt");
    w.write(path, *root);
    CHECK(produced == 1);
    const mt::TorchFile f(path);
    CHECK(same(f.tensor(at(f.root(), "m"), "m"), m));
    CHECK(same(f.tensor(at(f.root(), "s"), "s"), s));
    const mt::HostArray lazy = f.tensor(at(f.root(), "lazy"), "lazy");
    CHECK(lazy.dtype == mt::DType::bf16);
    CHECK(lazy.ptr<uint16_t>()[4] == 0x3f84);
    // the archive: one folder named after the file, data.pkl first, storages 64-byte aligned
    const mt::ZipArchive z(std::make_shared<mt::MappedFile>(path), 0, fs::file_size(path));
    for (const char* e : {"z64/data.pkl", "z64/version", "z64/byteorder", "z64/.format_version", "z64/data/0", "z64/data/2"})
      CHECK(z.find(zip64 ? e : "plain" + std::string(e).substr(3)));
    for (const auto& [name, e] : z.entries())
      if (name.find("/data/") != std::string::npos) CHECK(e.data_offset % 64 == 0);
    CHECK(std::string(reinterpret_cast<const char*>(z.bytes(*z.find(zip64 ? "z64/version" : "plain/version"))), 2) == "3\n");
  }
  CHECK_FALSE(fs::exists(tmp / "plain.pt.tmp-" + std::to_string(::getpid())));
}

TEST_CASE("PyTorch Distributed Checkpoint files written without PyTorch: chunks, objects and .metadata",
          "[megatron-export]") {
  TempDir tmp;
  mt::DcpWriter w(tmp.path());
  // a [2, 3, 4] tensor in two chunks along its first dimension, a whole [5] one, and an object
  auto chunk = [](int first) {
    mt::HostArray a = mt::HostArray::zeros(mt::DType::f32, {1, 3, 4});
    for (int i = 0; i < 12; ++i) a.ptr<float>()[i] = static_cast<float>(100 * first + i);
    return a;
  };
  for (const int l : {1, 0})
    w.tensor_chunk("stack", mt::DType::f32, {2, 3, 4}, {l, 0, 0}, {1, 3, 4}, [&chunk, l]() { return chunk(l); });
  mt::HostArray v = mt::HostArray::zeros(mt::DType::bf16, {5});
  for (int i = 0; i < 5; ++i) v.ptr<uint16_t>()[i] = static_cast<uint16_t>(0x3f80 + i);
  w.tensor_chunk("vec", mt::DType::bf16, {5}, {0}, {5}, [v]() { return v; });
  w.object("thing/shard_0_1", [](mt::TorchSaveWriter&) {
    mt::PickleRef d = mt::pickle_dict();
    mt::pickle_set(*d, "answer", mt::pickle_int(42));
    return d;
  });
  CHECK_THROWS_AS(w.tensor_chunk("vec", mt::DType::f32, {5}, {0}, {5}, [v]() { return v; }), mt::Error);
  CHECK_THROWS_AS(w.tensor_chunk("out", mt::DType::f32, {2}, {1}, {2}, [v]() { return v; }), mt::Error);
  w.finish(false);

  const std::string bytes = read_bytes(tmp / ".metadata");
  const mt::PickleRef meta = mt::read_pickle(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), "m");
  REQUIRE(meta->is_object("torch.distributed.checkpoint.metadata.Metadata"));
  CHECK(at(*meta, "version").text == "1.0.0");
  const mt::PickleValue& sdm = at(*meta, "state_dict_metadata");
  REQUIRE(sdm.entries.size() == 3);
  const mt::PickleValue& stack = at(sdm, "stack");
  REQUIRE(stack.is_object("torch.distributed.checkpoint.metadata.TensorStorageMetadata"));
  CHECK(at(stack, "size").items.at(0)->items.size() == 3);
  CHECK(at(stack, "properties").state->items.at(0)->text == "torch.float32");
  REQUIRE(at(stack, "chunks").items.size() == 2);
  CHECK(at(*at(stack, "chunks").items[0], "offsets").items.at(0)->items.at(0)->integer == 1);
  CHECK(at(at(sdm, "vec"), "properties").state->items.at(0)->text == "torch.bfloat16");
  CHECK(at(sdm, "thing/shard_0_1").is_object("torch.distributed.checkpoint.metadata.BytesStorageMetadata"));
  // every stored item: a torch.save archive where _StorageInfo says, holding what was written
  const auto file = std::make_shared<mt::MappedFile>(tmp / "__0_0.distcp");
  int items = 0;
  for (const auto& [index, info] : at(*meta, "storage_data").entries) {
    REQUIRE(index->is_object("torch.distributed.checkpoint.metadata.MetadataIndex"));
    REQUIRE(info->is_object("torch.distributed.checkpoint.filesystem._StorageInfo"));
    CHECK(at(*info, "relative_path").text == "__0_0.distcp");
    const mt::TorchFile f(file, static_cast<uint64_t>(at(*info, "offset").integer),
                          static_cast<uint64_t>(at(*info, "length").integer));
    const std::string fqn = at(*index, "fqn").text;
    INFO(fqn);
    if (fqn == "stack") {
      const int64_t first = at(*index, "offset").items.at(0)->items.at(0)->integer;
      CHECK(same(f.tensor(f.root(), fqn), chunk(static_cast<int>(first))));
    } else if (fqn == "vec") {
      CHECK(same(f.tensor(f.root(), fqn), v));
    } else {
      REQUIRE(f.root().is(mt::PickleKind::list));  // a ShardedObject: [object]
      CHECK(at(*f.root().items.at(0), "answer").integer == 42);
      CHECK(at(*index, "index").is(mt::PickleKind::none));
    }
    ++items;
  }
  CHECK(items == 4);
}

TEST_CASE("the RNG states are those Megatron-LM seeds at start-up", "[megatron-export]") {
  // Megatron-LM's own checkpoint: tensor rank 1, pipeline rank 1, seed 1234 (+ 100 for the stage).
  // Its Python and numpy generators and its CPU torch generator were never drawn from, so they
  // hold the seeded states; the CUDA generators had advanced (their offsets), not their seeds.
  const mt::TorchFile fixture(kFixtures + "/llama/torch_tp2pp2/iter_0000003/mp_rank_01_001/model_optim_rng.pt");
  const mt::PickleValue& theirs = *at(fixture.root(), "rng_state").items.at(0);
  mt::TorchSaveWriter w;
  const mt::PickleRef ours = mt::megatron_initial_rng_state(w, 1234, 1, 1, 0, false);
  // random.getstate(): (3, (624 words..., 624), None)
  const mt::PickleValue& rt = at(theirs, "random_rng_state");
  const mt::PickleValue& ro = at(*ours, "random_rng_state");
  REQUIRE(rt.items.size() == 3);
  REQUIRE(ro.items.size() == 3);
  CHECK(rt.items[0]->integer == ro.items[0]->integer);
  REQUIRE(rt.items[1]->items.size() == 625);
  REQUIRE(ro.items[1]->items.size() == 625);
  int differ = 0;
  for (size_t i = 0; i < 625; ++i) differ += rt.items[1]->items[i]->integer != ro.items[1]->items[i]->integer;
  CHECK(differ == 0);
  CHECK(ro.items[2]->is(mt::PickleKind::none));
  // numpy's state: ('MT19937', key, 624, 0, 0.0); Megatron's key is an ndarray whose bytes are the BUILD state's last item
  const mt::PickleValue& nt = at(theirs, "np_rng_state");
  const mt::PickleValue& no = at(*ours, "np_rng_state");
  REQUIRE(no.items.size() == 5);
  CHECK(no.items[0]->text == "MT19937");
  CHECK(no.items[2]->integer == nt.items[2]->integer);
  const std::string& key_bytes = nt.items[1]->state->items.back()->text;
  REQUIRE(key_bytes.size() == 624 * 4);
  differ = 0;
  for (size_t i = 0; i < 624; ++i) {
    uint32_t word = 0;
    std::memcpy(&word, key_bytes.data() + 4 * i, 4);
    differ += static_cast<int64_t>(word) != no.items[1]->items[i]->integer;
  }
  CHECK(differ == 0);
  // torch's CPU generator: byte for byte
  TempDir tmp;
  w.write(tmp / "rng.pt", *ours);
  const mt::TorchFile back(tmp / "rng.pt");
  const mt::HostArray cpu_theirs = fixture.tensor(at(theirs, "torch_rng_state"), "torch_rng_state");
  const mt::HostArray cpu_ours = back.tensor(at(back.root(), "torch_rng_state"), "torch_rng_state");
  CHECK(cpu_ours.shape == std::vector<int64_t>{5056});
  CHECK(same(cpu_theirs, cpu_ours));
  // CUDA states: (seed, offset) of 8 bytes each; the seeds agree
  auto seed_of = [](const mt::HostArray& a) {
    uint64_t s = 0;
    std::memcpy(&s, a.bytes.data(), 8);
    return s;
  };
  CHECK(seed_of(back.tensor(at(back.root(), "cuda_rng_state"), "c")) == 1334);
  CHECK(seed_of(fixture.tensor(at(theirs, "cuda_rng_state"), "c")) == 1334);
  for (const char* tracker : {"data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"}) {
    INFO(tracker);
    const mt::HostArray o = back.tensor(at(at(back.root(), "rng_tracker_states"), tracker), tracker);
    CHECK(o.shape == std::vector<int64_t>{16});
    CHECK(seed_of(o) == seed_of(fixture.tensor(at(at(theirs, "rng_tracker_states"), tracker), tracker)));
  }
}

namespace {

// Export options for the torch format (the default is torch_dist, Megatron-LM's).
mt::MegatronExportOptions torch_format(mt::MegatronExportOptions o = {}) {
  o.format = "torch";
  return o;
}

// Megatron-LM's checkpoint `fixture` imported into megatrain (tmp/imported) and exported again in
// the layout and format `o` asks for (tmp/megatron).
mt::MegatronExportResult import_and_export(const std::string& fixture, const TempDir& tmp, mt::MegatronExportOptions o,
                                           bool resumable = true) {
  const mt::MegatronImportResult in = mt::import_megatron(fixture, std::nullopt, tmp / "imported", false);
  if (resumable) REQUIRE(in.resumable);
  o.load = tmp / "imported";
  o.save = tmp / "megatron";
  return mt::export_megatron(o);
}

}  // namespace

TEST_CASE("export-megatron: a trained model goes to Megatron-LM's layout and back unchanged", "[megatron-export][binary]") {
  struct Case {
    const char* name;
    const std::string* model;
    std::string layout;  // export-megatron flags
    int files;
  };
  const std::vector<Case> cases = {
      {"llama, TP 2 x PP 2", &kLlama, "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2", 4},
      {"llama, PP 2 x 2 virtual stages, distributed optimizer",
       &kLlama, "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --use-distributed-optimizer", 4},
      {"llama, TP 2, distributed optimizer in 3000-element buckets",
       &kLlama, "--tensor-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 3000", 4},
      {"gpt (tied embeddings), TP 2 x PP 2, distributed optimizer",
       &kGpt, "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --use-distributed-optimizer", 8},
      {"gpt (tied embeddings), PP 2 x 2 virtual stages", &kGpt,
       "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2", 2},
      {"llama with attention sinks, TP 2, distributed optimizer", &kLlamaSinks,
       "--tensor-model-parallel-size 2 --use-distributed-optimizer", 4},
  };
  TempDir llama_dir, gpt_dir, sinks_dir;
  const std::string llama = train(llama_dir, kLlama), gpt = train(gpt_dir, kGpt), sinks = train(sinks_dir, kLlamaSinks);
  auto trained = [&](const std::string* model) { return model == &kLlama ? llama : model == &kGpt ? gpt : sinks; };
  for (const Case& c : cases) {
    INFO(c.name);
    TempDir tmp;
    std::string out;
    const int code = run_command(std::string(MEGATRAIN_BINARY) + " export-megatron --ckpt-format torch --load " +
                                     trained(c.model) + " --save " + (tmp / "megatron") + " " + c.layout,
                                 &out);
    INFO(out);
    REQUIRE(code == 0);
    CHECK_THAT(out, Catch::Contains("iteration 3") && Catch::Contains("--transformer-impl local"));
    CHECK(read_bytes(tmp / "megatron/latest_checkpointed_iteration.txt") == "3");
    int files = 0;
    for (const auto& e : fs::recursive_directory_iterator(tmp / "megatron/iter_0000003"))
      files += e.is_regular_file();
    CHECK(files == c.files);
    const mt::MegatronImportResult r = mt::import_megatron(tmp / "megatron", std::nullopt, tmp / "back", false);
    CHECK(r.resumable);
    CHECK(r.weights_only_reason.empty());
    CHECK(r.iteration == 3);
    require_same_state(trained(c.model), tmp / "back", true);
  }
}

TEST_CASE("export-megatron: the args Megatron-LM's loader reads", "[megatron-export]") {
  TempDir tmp;
  const std::string trained = train(tmp, kLlama);
  mt::MegatronExportOptions o = torch_format();
  o.load = trained;
  o.save = tmp / "megatron";
  o.tp = 2;
  o.dp = 4;
  const mt::MegatronExportResult r = mt::export_megatron(o);
  REQUIRE(r.files.size() == 2);
  CHECK(r.files[1] == "mp_rank_01/model_optim_rng.pt");
  const mt::TorchFile f(tmp / "megatron/iter_0000003/mp_rank_01/model_optim_rng.pt");
  const mt::PickleValue& root = f.root();
  CHECK(at(root, "checkpoint_version").floating == 3.0);
  CHECK(at(root, "iteration").integer == 3);
  CHECK(at(root, "num_floating_point_operations_so_far").floating > 0);
  const mt::PickleValue& args = at(root, "args");
  REQUIRE(args.is_object("argparse.Namespace"));
  auto integer = [&](const char* k) { return at(args, k).integer; };
  auto text = [&](const char* k) { return at(args, k).text; };
  auto flag = [&](const char* k) {
    const mt::PickleValue& v = at(args, k);
    REQUIRE(v.is(mt::PickleKind::boolean));
    return v.boolean;
  };
  // checkpointing.py's check_checkpoint_args and load_checkpoint
  CHECK(integer("num_layers") == 4);
  CHECK(integer("hidden_size") == 32);
  CHECK(integer("num_attention_heads") == 4);
  CHECK(flag("add_position_embedding"));  // --no-position-embedding not given (RoPE comes from its type)
  CHECK(integer("max_position_embeddings") == 16);
  CHECK(integer("make_vocab_size_divisible_by") == 32);
  CHECK(integer("padded_vocab_size") == 64);
  CHECK(text("tokenizer_type") == "NullTokenizer");
  CHECK(integer("vocab_size") == 60);
  CHECK(integer("tensor_model_parallel_size") == 2);
  CHECK(integer("pipeline_model_parallel_size") == 1);
  CHECK(integer("consumed_train_samples") == 12);
  CHECK(integer("skipped_train_samples") == 0);
  CHECK(integer("consumed_valid_samples") == 0);
  CHECK_FALSE(flag("data_parallel_random_init"));
  CHECK(integer("global_batch_size") == 4);
  // the layout and the run
  CHECK(integer("data_parallel_size") == 4);
  CHECK(integer("world_size") == 8);
  CHECK(integer("micro_batch_size") == 2);
  CHECK(integer("seed") == 1234);
  CHECK(integer("train_iters") == 3);
  CHECK(at(args, "lr").floating == 1e-3);
  CHECK(at(args, "min_lr").floating == 1e-4);
  CHECK(text("lr_decay_style") == "cosine");
  CHECK(text("transformer_impl") == "local");
  CHECK(text("ckpt_format") == "torch");
  CHECK_FALSE(flag("use_dist_ckpt"));
  CHECK_FALSE(flag("use_distributed_optimizer"));
  CHECK(at(args, "params_dtype").is(mt::PickleKind::global));
  CHECK(at(args, "params_dtype").text == "torch.float32");
  CHECK_FALSE(flag("bf16"));
  // the model, as import-megatron (and --use-checkpoint-args) read it
  CHECK(flag("swiglu"));
  CHECK(flag("group_query_attention"));
  CHECK(integer("num_query_groups") == 2);
  CHECK(integer("kv_channels") == 8);
  CHECK(integer("ffn_hidden_size") == 64);
  CHECK(text("normalization") == "RMSNorm");
  CHECK(text("position_embedding_type") == "rope");
  CHECK(flag("untie_embeddings_and_output_weights"));
  CHECK_FALSE(flag("add_bias_linear"));
  CHECK(flag("qk_layernorm"));
  CHECK(at(args, "layernorm_epsilon").floating == 1e-5);
  // the flags printed to continue with
  const std::string flags = fmt::format("{}", fmt::join(r.megatron_flags, " "));
  for (const char* f : {"--num-layers 4", "--swiglu", "--qk-layernorm", "--tensor-model-parallel-size 2",
                        "--tokenizer-type NullTokenizer", "--transformer-impl local", "--ckpt-format torch"})
    CHECK_THAT(flags, Catch::Contains(f));
}

namespace {

// Python values as equal as Python's == says (ints and floats by value); with `tensor_shapes`, two
// tensors are equal when their sizes are (their values compared elsewhere).
bool equal_values(const mt::PickleValue& a, const mt::PickleValue& b, bool tensor_shapes = false) {
  auto numeric = [](const mt::PickleValue& v) { return v.is(mt::PickleKind::integer) || v.is(mt::PickleKind::floating); };
  auto number = [](const mt::PickleValue& v) { return v.is(mt::PickleKind::integer) ? static_cast<double>(v.integer) : v.floating; };
  if (numeric(a) && numeric(b)) return number(a) == number(b);
  if (a.kind != b.kind) return false;
  if (tensor_shapes && mt::TorchFile::is_tensor(a) && mt::TorchFile::is_tensor(b))
    return equal_values(*a.items.at(2), *b.items.at(2));
  switch (a.kind) {
    case mt::PickleKind::none: return true;
    case mt::PickleKind::boolean: return a.boolean == b.boolean;
    case mt::PickleKind::string:
    case mt::PickleKind::bytes:
    case mt::PickleKind::global: return a.text == b.text;
    case mt::PickleKind::list:
    case mt::PickleKind::tuple:
      if (a.items.size() != b.items.size()) return false;
      for (size_t i = 0; i < a.items.size(); ++i)
        if (!equal_values(*a.items[i], *b.items[i], tensor_shapes)) return false;
      return true;
    case mt::PickleKind::dict:  // (keys in any order)
      if (a.entries.size() != b.entries.size()) return false;
      for (const auto& [k, v] : a.entries) {
        bool found = false;
        for (const auto& [k2, v2] : b.entries)
          if (equal_values(*k, *k2)) {
            found = equal_values(*v, *v2, tensor_shapes);
            break;
          }
        if (!found) return false;
      }
      return true;
    default: return false;
  }
}

struct Files {
  const mt::TorchFile& theirs;
  const mt::TorchFile& ours;
  void tensors(const mt::PickleValue& a, const mt::PickleValue& b, const std::string& what) const {
    INFO(what);
    REQUIRE(mt::TorchFile::is_tensor(a));
    REQUIRE(mt::TorchFile::is_tensor(b));
    CHECK(same(theirs.tensor(a, what), ours.tensor(b, what)));
  }
  // every key of Megatron's dict (except `skip`) in ours with an equal value
  void dict(const mt::PickleValue& a, const mt::PickleValue& b, const std::string& what,
            const std::set<std::string>& skip = {}) const {
    for (const auto& [k, v] : a.entries) {
      if (!k->is(mt::PickleKind::string) || skip.count(k->text)) continue;
      INFO(what << "." << k->text);
      const mt::PickleValue* mine = b.find(k->text);
      REQUIRE(mine);
      if (mt::TorchFile::is_tensor(*v)) tensors(*v, *mine, what + "." + k->text);
      else CHECK(equal_values(*v, *mine));
    }
  }
};

uint64_t seed_of(const mt::HostArray& a) {
  uint64_t s = 0;
  std::memcpy(&s, a.bytes.data(), 8);
  return s;
}

// The model chunks of a rank file: the same keys in the same order, the same tensors.
void compare_model_chunks(const Files& f) {
  const mt::PickleValue &a = f.theirs.root(), &b = f.ours.root();
  int chunks = 0;
  for (const auto& [k, v] : a.entries) {
    if (k->text.compare(0, 5, "model") != 0) continue;
    ++chunks;
    const mt::PickleValue& mine = at(b, k->text);
    // (torch's state dicts also carry each module's version as the attribute _metadata, which
    // the pickle reader lists as an entry; load_state_dict does without it)
    std::vector<std::pair<mt::PickleRef, mt::PickleRef>> theirs = v->entries;
    std::erase_if(theirs, [](const auto& e) { return e.first->text == "_metadata"; });
    REQUIRE(mine.entries.size() == theirs.size());
    for (size_t i = 0; i < theirs.size(); ++i) {
      const std::string& name = theirs[i].first->text;
      INFO(k->text << ": " << name);
      CHECK(mine.entries[i].first->text == name);
      if (theirs[i].second->is(mt::PickleKind::none)) CHECK(mine.entries[i].second->is(mt::PickleKind::none));
      else f.tensors(*theirs[i].second, *mine.entries[i].second, name);
    }
  }
  CHECK(chunks >= 1);
}

// One rank's model_optim_rng.pt as export-megatron wrote it against Megatron-LM's.
void compare_rank_file(const std::string& theirs_path, const std::string& ours_path) {
  const mt::TorchFile theirs(theirs_path), ours(ours_path);
  const Files f{theirs, ours};
  const mt::PickleValue &a = theirs.root(), &b = ours.root();
  for (const char* k : {"iteration", "checkpoint_version", "num_floating_point_operations_so_far"}) {
    INFO(k);
    CHECK(equal_values(at(a, k), at(b, k)));
  }
  compare_model_chunks(f);
  // the optimizer: torch's Adam state (alone or in Megatron's wrapper), or the distributed one's groups
  const mt::PickleValue& opt_a = at(a, "optimizer");
  const mt::PickleValue& opt_b = at(b, "optimizer");
  const bool wrapped = opt_a.find("optimizer") != nullptr;
  const mt::PickleValue& adam_a = wrapped ? at(opt_a, "optimizer") : opt_a;
  const mt::PickleValue& adam_b = wrapped ? at(opt_b, "optimizer") : opt_b;
  const mt::PickleValue& groups_a = at(adam_a, "param_groups");
  const mt::PickleValue& groups_b = at(adam_b, "param_groups");
  REQUIRE(groups_a.items.size() == groups_b.items.size());
  for (size_t g = 0; g < groups_a.items.size(); ++g) f.dict(*groups_a.items[g], *groups_b.items[g], "param group");
  if (const mt::PickleValue* state = adam_a.find("state")) {
    const mt::PickleValue& mine = at(adam_b, "state");
    CHECK(mine.entries.size() == state->entries.size());
    for (const auto& [k, v] : state->entries) {
      const mt::PickleValue* s = int_entry(mine, k->integer);
      REQUIRE(s);
      f.dict(*v, *s, "state " + std::to_string(k->integer));
    }
  }
  if (const mt::PickleValue* mains = opt_a.find("fp32_from_fp16_params")) {
    const mt::PickleValue& mine = at(opt_b, "fp32_from_fp16_params");
    REQUIRE(mine.items.size() == mains->items.size());
    for (size_t g = 0; g < mains->items.size(); ++g) {
      REQUIRE(mine.items[g]->items.size() == mains->items[g]->items.size());
      for (size_t i = 0; i < mains->items[g]->items.size(); ++i)
        f.tensors(*mains->items[g]->items[i], *mine.items[g]->items[i], "fp32_from_fp16_params");
    }
  }
  CHECK((opt_a.find("grad_scaler") != nullptr) == (opt_b.find("grad_scaler") != nullptr));
  if (const mt::PickleValue* scaler = opt_a.find("grad_scaler")) f.dict(*scaler, at(opt_b, "grad_scaler"), "grad_scaler");
  f.dict(at(a, "opt_param_scheduler"), at(b, "opt_param_scheduler"), "opt_param_scheduler");
  // the RNG states Megatron seeded
  const mt::PickleValue& rng_a = *at(a, "rng_state").items.at(0);
  const mt::PickleValue& rng_b = *at(b, "rng_state").items.at(0);
  CHECK(equal_values(at(rng_a, "random_rng_state"), at(rng_b, "random_rng_state")));
  const std::string& key_bytes = at(rng_a, "np_rng_state").items[1]->state->items.back()->text;
  const mt::PickleValue& key = *at(rng_b, "np_rng_state").items[1];
  REQUIRE(key.items.size() * 4 == key_bytes.size());
  uint32_t first = 0;
  std::memcpy(&first, key_bytes.data(), 4);
  CHECK(key.items[0]->integer == first);
  // torch's CPU generator: the same bytes where Megatron's was never drawn from (its `left`, the
  // int32 after the seed, still 1), the same seed where it was
  const mt::HostArray cpu_a = theirs.tensor(at(rng_a, "torch_rng_state"), "torch_rng_state");
  const mt::HostArray cpu_b = ours.tensor(at(rng_b, "torch_rng_state"), "torch_rng_state");
  REQUIRE(cpu_a.bytes.size() == 5056);
  int32_t left = 0;
  std::memcpy(&left, cpu_a.bytes.data() + 8, 4);
  if (left == 1) CHECK(same(cpu_a, cpu_b));
  else CHECK(seed_of(cpu_a) == seed_of(cpu_b));
  CHECK(seed_of(theirs.tensor(at(rng_a, "cuda_rng_state"), "c")) == seed_of(ours.tensor(at(rng_b, "cuda_rng_state"), "c")));
  // the arguments Megatron-LM's loader and import-megatron read
  const mt::PickleValue &args_a = at(a, "args"), &args_b = at(b, "args");
  for (const char* k : {"num_layers", "hidden_size", "num_attention_heads", "add_position_embedding", "max_position_embeddings",
                        "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type", "vocab_size",
                        "tensor_model_parallel_size", "pipeline_model_parallel_size", "consumed_train_samples",
                        "skipped_train_samples", "consumed_valid_samples", "data_parallel_random_init", "micro_batch_size",
                        "global_batch_size", "seed", "swiglu", "normalization", "position_embedding_type",
                        "group_query_attention", "num_query_groups", "kv_channels", "ffn_hidden_size",
                        "untie_embeddings_and_output_weights", "add_bias_linear", "qk_layernorm", "layernorm_epsilon",
                        "use_distributed_optimizer", "data_parallel_size", "world_size", "transformer_impl", "ckpt_format",
                        "use_dist_ckpt", "bf16", "fp16", "params_dtype", "virtual_pipeline_model_parallel_size",
                        "overlap_grad_reduce", "ddp_bucket_size", "hidden_dropout", "attention_dropout"}) {
    INFO("args." << k);
    const mt::PickleValue* mine = args_b.find(k);
    REQUIRE(mine);
    CHECK(equal_values(at(args_a, k), *mine));
  }
}

}  // namespace


TEST_CASE("export-megatron gives back the files Megatron-LM wrote", "[megatron-export]") {
  // Megatron-LM's torch-format checkpoints with their optimizer state, imported into megatrain
  // (import-megatron) and exported again in the same layout.
  struct Case {
    const char* dir;
    mt::MegatronExportOptions layout;
  };
  mt::MegatronExportOptions tp2pp2;
  tp2pp2.tp = tp2pp2.pp = 2;
  mt::MegatronExportOptions vpp = tp2pp2;
  vpp.vpp = 2;
  mt::MegatronExportOptions distopt;
  distopt.dp = 2;
  distopt.distributed_optimizer = true;
  distopt.overlap_grad_reduce = true;
  distopt.ddp_bucket_size = 3000;
  for (const Case& c : {Case{"llama/torch_tp2pp2", tp2pp2}, Case{"gpt/torch_tp2pp2vpp", vpp},
                        Case{"llama/torch_distopt_dp2", distopt}, Case{"gpt/fp16_torch", mt::MegatronExportOptions{}}}) {
    INFO(c.dir);
    TempDir tmp;
    const std::string fixture = kFixtures + "/" + c.dir;
    const mt::MegatronExportResult r = import_and_export(fixture, tmp, torch_format(c.layout));
    CHECK(r.iteration == 3);
    CHECK_FALSE(r.release);
    int compared = 0;
    for (const auto& e : fs::directory_iterator(fixture + "/iter_0000003")) {
      const std::string rank = e.path().filename();
      INFO(rank);
      const std::string ours = tmp / ("megatron/iter_0000003/" + rank);
      REQUIRE(fs::exists(ours + "/model_optim_rng.pt"));
      compare_rank_file(e.path() / "model_optim_rng.pt", ours + "/model_optim_rng.pt");
      ++compared;
      if (!fs::exists(e.path() / "distrib_optim.pt")) continue;
      // distrib_optim.pt: each chunk's buffers, byte for byte
      const mt::TorchFile theirs(e.path() / "distrib_optim.pt"), mine(ours + "/distrib_optim.pt");
      const Files f{theirs, mine};
      CHECK(equal_values(at(theirs.root(), "buckets_coalesced"), at(mine.root(), "buckets_coalesced")));
      for (const auto& [k, by_dtype] : theirs.root().entries) {
        if (!k->is(mt::PickleKind::integer)) continue;
        const mt::PickleValue* ours_by_dtype = int_entry(mine.root(), k->integer);
        REQUIRE(ours_by_dtype);
        REQUIRE(by_dtype->entries.size() == 1);
        REQUIRE(ours_by_dtype->entries.size() == 1);
        CHECK(equal_values(*by_dtype->entries[0].first, *ours_by_dtype->entries[0].first));
        f.dict(*by_dtype->entries[0].second, *ours_by_dtype->entries[0].second, "distrib_optim.pt");
      }
    }
    CHECK(compared == static_cast<int>(r.files.size()) - (c.layout.distributed_optimizer ? compared : 0));
  }
}

TEST_CASE("export-megatron gives back Megatron-LM's mixture-of-experts rank files, weights only", "[megatron-export][moe]") {
  // Megatron-LM's own torch-format MoE checkpoints (tests/fixtures/megatron/README.md: the local
  // spec's SequentialMLP experts, saved without optimizer state), imported and exported in the same
  // layout: every rank file's model state dict, its keys in order (the routers' expert_bias buffer,
  // each linear's _extra_state) and its tensors, and the args Megatron-LM reads the layout from.
  struct Case {
    const char* dir;
    mt::MegatronExportOptions layout;
  };
  mt::MegatronExportOptions ep2;
  ep2.ep = ep2.dp = 2;
  mt::MegatronExportOptions tp2;
  tp2.tp = 2;
  for (const Case& c : {Case{"moe/torch", {}}, Case{"moe_bias/torch", {}}, Case{"moe_ep2/torch", ep2},
                        Case{"moe_tp2/torch", tp2}}) {
    INFO(c.dir);
    TempDir tmp;
    const std::string fixture = kFixtures + "/" + c.dir;
    const mt::MegatronExportResult r = import_and_export(fixture, tmp, torch_format(c.layout), false);
    CHECK(r.release);
    CHECK_THAT(r.weights_only_reason, Catch::Contains("release checkpoint"));
    int compared = 0;
    for (const auto& e : fs::directory_iterator(fixture + "/iter_0000003")) {
      const std::string rank = e.path().filename();
      INFO(rank);
      const std::string ours = tmp / ("megatron/release/" + rank + "/model_optim_rng.pt");
      REQUIRE(fs::exists(ours));
      const mt::TorchFile theirs_file(e.path() / "model_optim_rng.pt"), ours_file(ours);
      compare_model_chunks(Files{theirs_file, ours_file});
      for (const char* k : {"tensor_model_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
                            "num_experts", "moe_layer_freq", "moe_router_topk"}) {
        INFO(k);
        CHECK(equal_values(at(at(theirs_file.root(), "args"), k), at(at(ours_file.root(), "args"), k)));
      }
      ++compared;
    }
    CHECK(compared == static_cast<int>(r.files.size()));
    // And back: the export imports to the same weights.
    REQUIRE_NOTHROW(mt::import_megatron(tmp / "megatron", std::nullopt, tmp / "back", false));
    require_same_state(tmp / "imported", tmp / "back", false, 19);
  }
}

TEST_CASE("export-megatron gives back Megatron-LM's rank file of a model with an MTP depth, weights only",
          "[megatron-export][mtp]") {
  // Megatron-LM's own torch-format checkpoint of the llama model with --mtp-num-layers 1
  // (tests/fixtures/megatron/README.md), imported and exported: the state dict's keys in order (the
  // depth's enorm, hnorm, eh_proj and its _extra_state, its mtp_model_layer, final_layernorm, after
  // the decoder and before the output layer) and every tensor.
  TempDir tmp;
  const std::string fixture = kFixtures + "/mtp/llama_mtp1_torch";
  const mt::MegatronExportResult r = import_and_export(fixture, tmp, torch_format(), false);
  CHECK(r.release);
  const mt::TorchFile theirs(fixture + "/iter_0000001/mp_rank_00/model_optim_rng.pt"),
      ours(tmp / "megatron/release/mp_rank_00/model_optim_rng.pt");
  compare_model_chunks(Files{theirs, ours});
  CHECK(at(ours.root(), "model").find("mtp.layers.0.mtp_model_layer.mlp.linear_fc1.weight") != nullptr);
  for (const char* k : {"mtp_num_layers", "mtp_loss_scaling_factor"}) {
    INFO(k);
    CHECK(equal_values(at(at(theirs.root(), "args"), k), at(at(ours.root(), "args"), k)));
  }
  mt::import_megatron(tmp / "megatron", std::nullopt, tmp / "back", false);
  require_same_state(tmp / "imported", tmp / "back", false);
}

TEST_CASE("export-megatron: a trained model with MTP depths goes to Megatron-LM's layout and back, weights only",
          "[megatron-export][mtp]") {
  // Two depths; dense at TP 2 (eh_proj's rows split as Megatron's column-parallel linear), and MoE
  // with the expert bias at EP 2 (the depths' experts and routers under their mtp_model_layer).
  struct Case {
    const std::string model;
    mt::MegatronExportOptions layout;
    const char* key;  // in the first rank file
  };
  mt::MegatronExportOptions tp2;
  tp2.tp = 2;
  mt::MegatronExportOptions ep2;
  ep2.ep = ep2.dp = 2;
  for (const Case& c : {Case{kLlama, tp2, "mtp.layers.1.eh_proj.weight"},
                        Case{kMoe, ep2, "mtp.layers.1.mtp_model_layer.mlp.experts.local_experts.1.linear_fc2.weight"}}) {
    INFO(c.model);
    TempDir tmp;
    const std::string trained = train(tmp, c.model + " --mtp-num-layers 2");
    mt::MegatronExportOptions o = torch_format(c.layout);
    o.load = trained;
    o.save = tmp / "megatron";
    const mt::MegatronExportResult r = mt::export_megatron(o);
    CHECK(r.release);
    CHECK_THAT(r.weights_only_reason, Catch::Contains("multi-token prediction") || Catch::Contains("mixture-of-experts"));
    const mt::TorchFile f(tmp / (std::string("megatron/release/") + (c.layout.ep > 1 ? "mp_rank_00_000" : "mp_rank_00") +
                                 "/model_optim_rng.pt"));
    const mt::PickleValue* v = at(f.root(), "model").find(c.key);
    REQUIRE(v != nullptr);
    if (c.layout.tp == 2) {
      const mt::HostArray a = f.tensor(*v, c.key);
      CHECK(a.shape == std::vector<int64_t>{16, 64});  // [h / TP, 2h]
    }
    mt::import_megatron(tmp / "megatron", std::nullopt, tmp / "back", false);
    require_same_state(trained, tmp / "back", false);
  }
  // Pipeline parallel 2 (TP 2): the last stage holds the depth and its own copy of the word
  // embeddings, registered first (Megatron's GPTModel builds an embedding on its MTP stage), the
  // output layer last.
  TempDir tmp;
  mt::MegatronExportOptions o = torch_format();
  o.load = train(tmp, kLlama + " --mtp-num-layers 1");
  o.save = tmp / "megatron";
  o.pp = o.tp = 2;
  REQUIRE(mt::export_megatron(o).release);
  for (const char* rank : {"mp_rank_00_001", "mp_rank_01_001"}) {
    INFO(rank);
    const mt::TorchFile f(tmp / (std::string("megatron/release/") + rank + "/model_optim_rng.pt"));
    const mt::PickleValue& model = at(f.root(), "model");
    REQUIRE(model.entries.size() > 3);
    CHECK(model.entries.front().first->text == "embedding.word_embeddings.weight");
    CHECK(model.entries[model.entries.size() - 2].first->text == "output_layer.weight");
    CHECK(model.find("mtp.layers.0.mtp_model_layer.self_attention.linear_qkv.weight") != nullptr);
    CHECK(model.find("decoder.layers.1.mlp.linear_fc2.weight") != nullptr);
    CHECK(model.find("decoder.layers.2.mlp.linear_fc2.weight") == nullptr);  // (stage-local numbers)
  }
  const mt::TorchFile first(tmp / "megatron/release/mp_rank_00_000/model_optim_rng.pt");
  CHECK(at(first.root(), "model").find("mtp.layers.0.eh_proj.weight") == nullptr);
  mt::import_megatron(tmp / "megatron", std::nullopt, tmp / "back", false);
  require_same_state(o.load, tmp / "back", false);
}

TEST_CASE("export-megatron: MoE expert biases go to Megatron-LM's names and back",
          "[megatron-export][moe]") {
  TempDir tmp;
  const std::string trained = train(tmp, kMoe);
  mt::MegatronExportOptions o = torch_format();
  o.load = trained;
  o.save = tmp / "megatron";
  REQUIRE(mt::export_megatron(o).release);  // (MoE models in the torch format: weights only)
  const mt::TorchFile f(tmp / "megatron/release/mp_rank_00/model_optim_rng.pt");
  CHECK(at(f.root(), "model").find("decoder.layers.3.mlp.router.expert_bias") != nullptr);
  mt::import_megatron(tmp / "megatron", std::nullopt, tmp / "back", false);
  require_same_state(trained, tmp / "back", false);
  // Trained: the biases moved from zero (so the comparison above is not of zeros).
  mt::CheckpointReader r(tmp / "back");
  const mt::HostArray b = read_whole(r, "decoder.layers.3.mlp.router.expert_bias", mt::CheckpointKind::model);
  REQUIRE(b.dtype == mt::DType::f32);
  const float* v = reinterpret_cast<const float*>(b.bytes.data());
  CHECK(std::any_of(v, v + b.numel(), [](float x) { return x != 0.0f; }));
}

TEST_CASE("export-megatron: weights only, and what it refuses", "[megatron-export]") {
  TempDir tmp;
  const std::string trained = train(tmp, kGpt);
  mt::MegatronExportOptions o = torch_format();
  o.load = trained;
  o.save = tmp / "weights";
  o.weights_only = true;
  const mt::MegatronExportResult w = mt::export_megatron(o);
  CHECK(w.release);
  CHECK(read_bytes(tmp / "weights/latest_checkpointed_iteration.txt") == "release");
  const mt::TorchFile f(tmp / "weights/release/mp_rank_00/model_optim_rng.pt");
  CHECK(f.root().find("optimizer") == nullptr);
  CHECK(f.root().find("rng_state") == nullptr);
  CHECK(at(at(f.root(), "args"), "consumed_train_samples").integer == 0);
  // the tied output layer on the embedding's stage holds no weight, only its extra state
  CHECK(at(f.root(), "model").find("output_layer.weight") == nullptr);
  CHECK(at(at(f.root(), "model"), "output_layer._extra_state").is(mt::PickleKind::none));
  const mt::MegatronImportResult back = mt::import_megatron(tmp / "weights", std::nullopt, tmp / "back", false);
  CHECK_FALSE(back.resumable);
  require_same_state(trained, tmp / "back", false);

  // a tensor-parallel size Megatron pads the vocabulary differently for (60 + 1 tokens: 64 rows
  // with 32 x TP 2, 128 with 32 x TP 4)
  o.weights_only = false;
  o.save = tmp / "tp4";
  o.tp = 4;
  CHECK_THROWS_WITH(mt::export_megatron(o), Catch::Contains("128 rows") && Catch::Contains("embedding has 64") &&
                                                Catch::Contains("--make-vocab-size-divisible-by 16"));
  o.make_vocab_size_divisible_by = 16;
  CHECK(mt::export_megatron(o).tp == 4);
  o.tp = 8;  // 4 heads
  o.make_vocab_size_divisible_by = 8;
  CHECK_THROWS_WITH(mt::export_megatron(o), Catch::Contains("--num-attention-heads (4)") &&
                                                Catch::Contains("--tensor-model-parallel-size (8)"));
  o.tp = 1;
  o.pp = 3;  // 4 layers
  CHECK_THROWS_AS(mt::export_megatron(o), mt::Error);
  o.pp = 1;
  o.format = "torch_dcp";
  CHECK_THROWS_AS(mt::export_megatron(o), mt::Unsupported);
  o.format = "fsdp_dtensor";
  o.pp = 2;  // (written for pipeline-parallel size 1 only)
  CHECK_THROWS_WITH(mt::export_megatron(o), Catch::Contains("--pipeline-model-parallel-size 1"));
  o.pp = 1;
  mt::MegatronExportOptions missing;
  missing.load = tmp / "nothing";
  missing.save = tmp / "out";
  CHECK_THROWS_WITH(mt::export_megatron(missing), Catch::Contains("latest_checkpointed_iteration.txt"));
}

namespace {

// A torch_dist checkpoint's stored items as its .metadata lists them: a tensor's global size and
// dtype ("[4, 64, 32] torch.float32"), an object's "bytes"; Megatron-LM's rerun state left out
// (megatrain writes none: Megatron-LM then starts its rerun state machine afresh).
std::map<std::string, std::string> dcp_items(const std::string& iteration_dir) {
  const std::string path = iteration_dir + "/.metadata";
  const std::string bytes = read_bytes(path);
  const mt::PickleRef meta =
      mt::read_pickle(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), path);
  REQUIRE(meta->is_object("torch.distributed.checkpoint.metadata.Metadata"));
  std::map<std::string, std::string> out;
  for (const auto& [k, md] : at(*meta, "state_dict_metadata").entries) {
    if (k->text.compare(0, 25, "rerun_state_machine_state") == 0) continue;
    if (md->is_object("torch.distributed.checkpoint.metadata.BytesStorageMetadata")) {
      out[k->text] = "bytes";
      continue;
    }
    REQUIRE(md->is_object("torch.distributed.checkpoint.metadata.TensorStorageMetadata"));
    std::vector<int64_t> size;
    for (const auto& d : at(*md, "size").items.at(0)->items) size.push_back(d->integer);
    out[k->text] = fmt::format("{} {}", fmt::join(size, ","), at(*md, "properties").state->items.at(0)->text);
  }
  // the stored items lie where .metadata says: each a torch.save archive
  for (const auto& [index, info] : at(*meta, "storage_data").entries) {
    const std::string file = iteration_dir + "/" + at(*info, "relative_path").text;
    const int64_t offset = at(*info, "offset").integer, length = at(*info, "length").integer;
    INFO(at(*index, "fqn").text);
    REQUIRE(offset + length <= static_cast<int64_t>(fs::file_size(file)));
    CHECK(read_bytes(file).substr(static_cast<size_t>(offset), 4) == std::string("PK\x03\x04", 4));
  }
  return out;
}

}  // namespace

TEST_CASE("export-megatron --ckpt-format torch_dist: a trained model goes to Megatron-LM's keys and back unchanged",
          "[megatron-export][binary]") {
  struct Case {
    const char* name;
    const std::string* model;
    std::string extra;   // training flags
    std::string layout;  // export-megatron flags
  };
  const std::vector<Case> cases = {
      {"llama, TP 2, distributed optimizer", &kLlama, "", "--tensor-model-parallel-size 2 --use-distributed-optimizer"},
      {"llama, PP 2", &kLlama, "", "--pipeline-model-parallel-size 2"},
      {"gpt (tied embeddings), PP 2 x 2 virtual stages, distributed optimizer", &kGpt, "",
       "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --use-distributed-optimizer"},
      {"gpt (tied embeddings), TP 2 x PP 2", &kGpt, "", "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"},
      {"llama with attention sinks", &kLlamaSinks, "", ""},
      {"MoE (expert bias), PP 2", &kMoe, "", "--pipeline-model-parallel-size 2"},
      {"MoE (expert bias), TP 2, distributed optimizer", &kMoe, "", "--tensor-model-parallel-size 2 --use-distributed-optimizer"},
      {"llama with an MTP depth", &kLlama, "--mtp-num-layers 1", ""},
      {"MoE, EP 2 x DP 2 (the experts' optimizer chained)", &kMoe, "",
       "--expert-model-parallel-size 2 --data-parallel-size 2"},
      {"MoE, EP 2 x DP 2, distributed optimizer", &kMoe, "",
       "--expert-model-parallel-size 2 --data-parallel-size 2 --use-distributed-optimizer"},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    TempDir tmp;
    const std::string trained = train(tmp, *c.model, c.extra);
    std::string out;
    const int code = run_command(std::string(MEGATRAIN_BINARY) + " export-megatron --ckpt-format torch_dist --load " +
                                     trained + " --save " + (tmp / "megatron") + " " + c.layout,
                                 &out);
    INFO(out);
    REQUIRE(code == 0);
    const bool distributed = c.layout.find("--use-distributed-optimizer") != std::string::npos;
    CHECK_THAT(out, Catch::Contains("torch_dist format, iteration 3") && Catch::Contains("--ckpt-format torch_dist"));
    CHECK((out.find("--use-distributed-optimizer") != std::string::npos) == distributed);
    const std::string dir = tmp / "megatron/iter_0000003";
    CHECK(read_bytes(dir + "/metadata.json") == R"({"sharded_backend": "torch_dist", "sharded_backend_version": 1})");
    const std::map<std::string, std::string> items = dcp_items(dir);
    CHECK(items.count("common_state/shard_0_1"));
    // (MoE models: the layers keyed one by one; their experts under experts.experts)
    const std::string layers = c.model == &kMoe ? "decoder.layers.3." : "decoder.layers.";
    const std::string fc2 = c.model == &kMoe ? "mlp.experts.experts.linear_fc2" : "mlp.linear_fc2";
    // (the extra state of layer 3 of 4 when stacked; of expert 3 of 4 in an MoE layer keyed on its own)
    CHECK(items.count(layers + fc2 + "._extra_state/shard_3_4"));
    CHECK(items.count("optimizer.state.exp_avg_sq." + layers + "self_attention.linear_proj.weight"));
    CHECK(items.count("optimizer.state.exp_avg." + layers + fc2 + ".weight"));
    if (c.model == &kMoe) CHECK(items.count("decoder.layers.3.mlp.router.expert_bias"));
    if (c.extra == "--mtp-num-layers 1") CHECK(items.count("optimizer.state.exp_avg.mtp.layers.0.eh_proj.weight"));
    // main weights: the distributed optimizer's "param"; none for the float32 model's Adam
    CHECK(items.count("optimizer.state.param.decoder.final_layernorm.weight") == distributed);
    CHECK(items.count("optimizer.state.fp32_param.decoder.final_layernorm.weight") == 0);
    CHECK(items.count("output_layer.weight") == (c.model != &kGpt));
    // Megatron-LM's ChainedOptimizer with expert parallelism: the dense parameters' optimizer state
    // (two param groups), then the experts' (one, is_expert_parallel), keyed 0 and 1
    const mt::MegatronCheckpoint exported(tmp / "megatron", std::nullopt);
    const mt::PickleValue& opt = at(*exported.common_state(), "optimizer");
    const bool chained = c.layout.find("--expert-model-parallel-size 2") != std::string::npos;
    CHECK((int_entry(opt, 1) != nullptr) == chained);
    if (chained) {
      auto groups = [&](int64_t k) -> const mt::PickleValue& {
        const mt::PickleValue* o = int_entry(opt, k);
        REQUIRE(o != nullptr);
        return distributed ? at(at(*o, "optimizer"), "param_groups") : at(*o, "param_groups");
      };
      REQUIRE(groups(0).items.size() == 2);
      REQUIRE(groups(1).items.size() == 1);
      CHECK_FALSE(at(*groups(0).items[0], "is_expert_parallel").boolean);
      CHECK(at(*groups(1).items[0], "is_expert_parallel").boolean);
    }
    const mt::MegatronImportResult r = mt::import_megatron(tmp / "megatron", std::nullopt, tmp / "back", false);
    CHECK(r.resumable);
    CHECK(r.weights_only_reason.empty());
    CHECK(r.iteration == 3);
    require_same_state(trained, tmp / "back", true, 20);
  }
}

TEST_CASE("export-megatron --ckpt-format torch_dist gives back the checkpoints Megatron-LM wrote",
          "[megatron-export]") {
  // Megatron-LM's torch_dist checkpoints with the distributed optimizer's fully reshardable state
  // (float32 Llama at DP 2; bf16 GPT with tied embeddings and float32 main weights at TP 2 x PP 2
  // x 2 virtual stages) and with the non-distributed optimizer (fp16 GPT: main weights, loss
  // scaler), imported and exported in the same layout: the same items (keys, global sizes, dtypes),
  // tensors, optimizer state and common state.
  struct Case {
    const char* dir;
    mt::MegatronExportOptions layout;
  };
  mt::MegatronExportOptions dp2;
  dp2.dp = 2;
  dp2.distributed_optimizer = true;
  mt::MegatronExportOptions vpp;
  vpp.tp = vpp.pp = vpp.vpp = 2;
  vpp.distributed_optimizer = true;
  for (const Case& c : {Case{"llama/distopt_dp2_full", dp2}, Case{"gpt/distopt_tp2pp2vpp_full", vpp},
                        Case{"gpt/fp16_dist", mt::MegatronExportOptions{}}}) {
    INFO(c.dir);
    TempDir tmp;
    const std::string fixture = kFixtures + "/" + c.dir;
    mt::MegatronExportOptions o = c.layout;
    o.format = "torch_dist";
    const mt::MegatronExportResult r = import_and_export(fixture, tmp, o);
    CHECK(r.iteration == 3);
    CHECK(r.distributed_optimizer == c.layout.distributed_optimizer.value_or(false));
    CHECK(dcp_items(tmp / "megatron/iter_0000003") == dcp_items(fixture + "/iter_0000003"));
    const mt::MegatronCheckpoint theirs(fixture, std::nullopt), ours(tmp / "megatron", std::nullopt);
    REQUIRE(ours.format() == "torch_dist");
    REQUIRE(ours.parameter_names() == theirs.parameter_names());
    int compared = 0;
    for (const std::string& name : theirs.parameter_names()) {
      INFO(name);
      CHECK(same(ours.parameter(name), theirs.parameter(name)));
      for (const char* state : {"exp_avg", "exp_avg_sq", "fp32_param"}) {
        const auto a = theirs.optimizer_state(state, name), b = ours.optimizer_state(state, name);
        REQUIRE(a.has_value() == b.has_value());
        if (a) CHECK(same(*a, *b));
        compared += a.has_value();
      }
    }
    CHECK(compared >= 2 * 16);
    CHECK(ours.optimizer_step() == theirs.optimizer_step());
    CHECK(ours.distributed_optimizer() == theirs.distributed_optimizer());
    const auto sa = theirs.grad_scaler(), sb = ours.grad_scaler();
    REQUIRE(sa.has_value() == sb.has_value());
    if (sa) {
      CHECK(sa->scale == sb->scale);
      CHECK(sa->growth_tracker == sb->growth_tracker);
      CHECK(sa->hysteresis_tracker == sb->hysteresis_tracker);
    }
    const mt::PickleValue &ca = *theirs.common_state(), &cb = *ours.common_state();
    for (const char* k : {"checkpoint_version", "iteration", "optimizer", "opt_param_scheduler",
                          "num_floating_point_operations_so_far", "content_metadata"}) {
      INFO(k);
      CHECK(equal_values(at(ca, k), at(cb, k), true));
    }
  }
}

TEST_CASE("export-megatron --ckpt-format torch_dist gives back Megatron-LM's MoE, MLA and MTP checkpoints",
          "[megatron-export][moe]") {
  // Megatron-LM's torch_dist checkpoints of the local spec, imported and exported: the same
  // parameters, and (where megatrain keys the layers as Megatron-LM did) the same items; with the
  // optimizer (moe_resume/dist: the non-distributed optimizer, which Megatron-LM chains for the
  // experts) the same state, step and common state.
  // Megatron-LM stacks the layers of an MoE model whose every layer is MoE (--moe-layer-freq 1);
  // megatrain keys an MoE model's layers one by one (its non-homogeneous layers, which the content
  // metadata asks the loading run for): those come back by value only. MoE and MTP models export
  // their weights only, so only the weights are compared there.
  struct Case {
    const char* dir;
    bool same_items;
  };
  for (const Case& c : {Case{"moe/dist", true}, Case{"moe_ep2/dist", true}, Case{"moe_resume/dist", true},
                        Case{"mla/dist", true},
                        Case{"mtp/llama_mtp1", true}, Case{"mtp/llama_mtp2", true}, Case{"moe_bias/dist", false},
                        Case{"mtp/moe_bias_mtp1", false}}) {
    INFO(c.dir);
    TempDir tmp;
    const std::string fixture = kFixtures + "/" + c.dir;
    mt::MegatronExportOptions o;
    o.format = "torch_dist";
    const mt::MegatronExportResult r = import_and_export(fixture, tmp, o, false);
    const mt::MegatronCheckpoint theirs(fixture, std::nullopt), ours(tmp / "megatron", std::nullopt);
    const std::string their_dir = theirs.directory(), our_dir = ours.directory();
    if (c.same_items) {
      std::map<std::string, std::string> a = dcp_items(their_dir), b = dcp_items(our_dir);
      if (r.release) std::erase_if(a, [](const auto& e) { return e.first.compare(0, 9, "rng_state") == 0; });
      CHECK(a == b);
    }
    REQUIRE(ours.parameter_names() == theirs.parameter_names());
    for (const std::string& name : theirs.parameter_names()) {
      INFO(name);
      CHECK(same(ours.parameter(name), theirs.parameter(name)));
      if (r.release) continue;
      for (const char* state : {"exp_avg", "exp_avg_sq", "fp32_param"}) {
        const auto sa = theirs.optimizer_state(state, name), sb = ours.optimizer_state(state, name);
        REQUIRE(sa.has_value() == sb.has_value());
        if (sa) CHECK(same(*sa, *sb));
      }
    }
    if (!r.release) {
      CHECK(ours.optimizer_step() == theirs.optimizer_step());
      for (const char* k : {"iteration", "optimizer", "opt_param_scheduler"}) {
        INFO(k);
        CHECK(equal_values(at(*theirs.common_state(), k), at(*ours.common_state(), k), true));
      }
      // The content metadata as Megatron-LM's, but for the per-layer keys megatrain asks for
      // (non_homogeneous_layers), which Megatron-LM's own mixed dense/MoE model keys without saying.
      mt::PickleValue content = at(*ours.common_state(), "content_metadata");
      std::erase_if(content.entries, [](const auto& e) { return e.first->text == "non_homogeneous_layers"; });
      CHECK(equal_values(at(*theirs.common_state(), "content_metadata"), content, true));
    }
  }
}

TEST_CASE("export-megatron --ckpt-format torch_dist: weights only", "[megatron-export]") {
  TempDir tmp, moe_dir, llama_dir;
  mt::MegatronExportOptions o;
  o.load = train(moe_dir, kMoe);
  o.save = tmp / "moe";
  o.format = "torch_dist";
  o.weights_only = true;
  const mt::MegatronExportResult moe = mt::export_megatron(o);
  CHECK(moe.release);
  const mt::MegatronImportResult moe_back = mt::import_megatron(tmp / "moe", std::nullopt, tmp / "moe_back", false);
  CHECK_FALSE(moe_back.resumable);
  require_same_state(o.load, tmp / "moe_back", false);
  const std::string llama = train(llama_dir, kLlama);
  o = mt::MegatronExportOptions{};
  o.format = "torch_dist";
  o.load = llama;
  o.weights_only = true;
  o.save = tmp / "weights";
  const mt::MegatronExportResult w = mt::export_megatron(o);
  CHECK(w.release);
  CHECK_FALSE(w.distributed_optimizer);
  const std::map<std::string, std::string> items = dcp_items(tmp / "weights/release");
  CHECK(items.count("decoder.layers.self_attention.linear_qkv.weight"));
  for (const auto& [k, v] : items) {
    INFO(k);
    CHECK(k.compare(0, 10, "optimizer.") != 0);
    CHECK(k.compare(0, 9, "rng_state") != 0);
  }
  const mt::MegatronImportResult back = mt::import_megatron(tmp / "weights", std::nullopt, tmp / "back", false);
  CHECK_FALSE(back.resumable);
  require_same_state(llama, tmp / "back", false);
}

TEST_CASE("a run resumed from an exported and re-imported checkpoint repeats the straight run", "[megatron-export][binary]") {
  struct Case {
    const char* name;
    std::string model;
    std::string export_flags;
  };
  for (const Case& c :
       {Case{"llama, torch format, PP 2, distributed optimizer", kLlama,
             "--ckpt-format torch --pipeline-model-parallel-size 2 --use-distributed-optimizer"},
        Case{"MoE with a dense first layer and an MTP depth, torch_dist",
             kMoe + " --moe-layer-freq [0,1,1,1] --mtp-num-layers 1", "--ckpt-format torch_dist"},
        Case{"MoE, torch_dist at EP 2 x DP 2, distributed optimizer", kMoe,
             "--ckpt-format torch_dist --expert-model-parallel-size 2 --data-parallel-size 2 --use-distributed-optimizer"}}) {
    INFO(c.name);
    TempDir tmp;
    const std::string run = std::string(MEGATRAIN_BINARY) + " " + kCommon + " " + c.model + " --train-iters 5";
    std::string straight, out;
    REQUIRE(run_command(run + " --save " + (tmp / "a") + " --save-interval 3", &straight) == 0);
    REQUIRE(run_command(std::string(MEGATRAIN_BINARY) + " export-megatron --load " + (tmp / "a") + " --ckpt-step 3 --save " +
                            (tmp / "megatron") + " " + c.export_flags,
                        &out) == 0);
    INFO(out);
    CHECK_THAT(out, Catch::Contains("with the optimizer state"));
    REQUIRE(run_command(std::string(MEGATRAIN_BINARY) + " import-megatron --load " + (tmp / "megatron") + " --save " +
                            (tmp / "back"),
                        &out) == 0);
    std::string resumed;
    REQUIRE(run_command(run + " --load " + (tmp / "back"), &resumed) == 0);
    INFO(resumed);
    const auto a = losses_and_norms(straight), b = losses_and_norms(resumed);
    REQUIRE(a.size() == 5);
    REQUIRE(b.size() == 2);
    // iteration 4 as printed; 5 (the second of a resumed run) is the mean of 4 and 5, as Megatron-LM prints it
    CHECK(b[0].first == a[3].first);
    CHECK(std::abs(b[1].first - (a[3].first + a[4].first) / 2) <= 1e-6 * std::abs(a[4].first));
    CHECK(b[1].second == a[4].second);
  }
}

namespace {

// tests/oracles/megatron_export_check.py over a llama model exported in two layouts.
void run_export_oracle(const std::string& python, bool with_torch) {
  TempDir tmp;
  const std::string trained = train(tmp, kLlama);
  for (const char* layout : {"--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2",
                             "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
                             "--use-distributed-optimizer"}) {
    INFO(layout);
    const std::string out_dir = tmp / "megatron";
    fs::remove_all(out_dir);
    std::string out;
    REQUIRE(run_command(std::string(MEGATRAIN_BINARY) + " export-megatron --ckpt-format torch --load " + trained +
                            " --save " + out_dir + " " +
                            layout,
                        &out) == 0);
    const int code = run_command(python + " tests/oracles/megatron_export_check.py " + trained + "/iter_0000003 " +
                                     out_dir + (with_torch ? " --torch" : ""),
                                 &out);
    INFO(out);
    CHECK(code == 0);
    CHECK_THAT(out, Catch::Contains("\"problems\": []"));
    if (with_torch) CHECK_THAT(out, Catch::Contains("\"torch\": true"));
  }
}

}  // namespace

TEST_CASE("export-megatron's files pass what torch.load(weights_only=True) checks, and Python reads the shards back",
          "[megatron-export][python]") {
  const auto python = mt::oracle::python_or_skip("export-megatron oracle");
  if (!python) return;
  run_export_oracle(*python, false);
}

TEST_CASE("torch.load reads export-megatron's files", "[megatron-export][python][torch]") {
  const auto python = mt::oracle::python_or_skip("export-megatron torch.load");
  if (!python) return;
  if (run_command(*python + " -c 'import torch'") != 0) MT_SKIP("torch.load check: " << *python << " has no torch");
  run_export_oracle(*python, true);
}

TEST_CASE("export-megatron --ckpt-format fsdp_dtensor writes the items Megatron-FSDP wrote", "[megatron-export]") {
  // make_fsdp_fixtures.sh: checkpoints Megatron-LM's Megatron-FSDP saved (float32, a SwiGLU llama
  // and an MoE model with a gated shared expert). Imported and exported again, every item is
  // there under Megatron-FSDP's key with its size and dtype, and reads back bit for bit. (The RNG
  // states differ in size only: Megatron-LM on the CPU kept CPU generator states in its CUDA
  // slots, 5056 bytes, where a GPU's Philox state is 16. Megatron-FSDP resuming these exports on
  // the CPU repeats its own losses: bench/RESULTS.md.)
  for (const char* dir : {"fsdp/llama", "fsdp/moe"}) {
    INFO(dir);
    const std::string megatron_dir = kFixtures + "/" + dir;
    TempDir tmp;
    mt::import_megatron(megatron_dir, std::nullopt, tmp / "imported", false);
    mt::MegatronExportOptions o;
    o.load = tmp / "imported";
    o.save = tmp / "fsdp";
    o.format = "fsdp_dtensor";
    const mt::MegatronExportResult r = mt::export_megatron(o);
    CHECK_FALSE(r.release);
    CHECK(r.iteration == 2);
    std::map<std::string, std::string> theirs = dcp_items(megatron_dir + "/iter_0000002");
    std::map<std::string, std::string> ours = dcp_items(tmp / "fsdp/iter_0000002");
    for (auto* items : {&theirs, &ours})
      for (auto& [key, item] : *items)
        if (key.starts_with("rng_state.") && item.ends_with("torch.uint8") && !key.ends_with("torch_rng_state"))
          item = "a generator state";
    CHECK(ours == theirs);
    const mt::MegatronCheckpoint a(megatron_dir, std::nullopt), b(tmp / "fsdp", std::nullopt);
    CHECK(b.format() == "fsdp_dtensor");
    CHECK(b.optimizer_step() == a.optimizer_step());
    REQUIRE(b.parameter_names() == a.parameter_names());
    for (const std::string& name : a.parameter_names()) {
      INFO(name);
      CHECK(b.parameter(name).bytes == a.parameter(name).bytes);
      for (const char* state : {"exp_avg", "exp_avg_sq"}) {
        const std::optional<mt::HostArray> sa = a.optimizer_state(state, name), sb = b.optimizer_state(state, name);
        REQUIRE(sa.has_value() == sb.has_value());
        if (sa) CHECK(sb->bytes == sa->bytes);
      }
    }
    CHECK(mt::megatron_int_arg(b.args(), "num_layers", 0) == mt::megatron_int_arg(a.args(), "num_layers", 0));
    CHECK(mt::megatron_bool_arg(b.args(), "use_megatron_fsdp"));
  }
}
