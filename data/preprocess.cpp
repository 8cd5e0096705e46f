#include "data/preprocess.h"

#include <fmt/format.h>
#include <glob.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <thread>

#include "core/error.h"
#include "data/indexed_dataset.h"
#include "data/json_line.h"
#include "data/line_reader.h"

namespace mt {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// The tokens of one chunk for one key: documents back to back.
struct KeyTokens {
  std::vector<int32_t> tokens;
  std::vector<int32_t> sequence_lengths;
  std::vector<int32_t> sequences_per_document;
};

struct ChunkResult {
  uint64_t sequence = 0;
  uint64_t first_global = 0;   // global index of the chunk's first line (partition assignment)
  size_t file = 0;             // index of the chunk's input file
  int64_t documents = 0;       // lines fully processed (all of them unless error is set)
  uint64_t bytes = 0;
  std::vector<KeyTokens> keys;
  std::string error;           // the first failure in this chunk (after `documents` good lines)
  bool end = false;            // the reader's last message: no more chunks
};

// Chunks handed from the reader to the workers (bounded by the in-flight limit below).
class WorkQueue {
 public:
  void push(LineChunk chunk) {
    std::lock_guard lock(mu_);
    items_.push_back(std::move(chunk));
    cv_.notify_one();
  }
  void close() {
    std::lock_guard lock(mu_);
    closed_ = true;
    cv_.notify_all();
  }
  std::optional<LineChunk> pop() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return closed_ || !items_.empty(); });
    if (items_.empty()) return std::nullopt;
    LineChunk c = std::move(items_.front());
    items_.pop_front();
    return c;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<LineChunk> items_;
  bool closed_ = false;
};

// Results waiting to be written in order, and the count of chunks in flight (read but not yet
// written) that bounds memory.
class ResultBoard {
 public:
  explicit ResultBoard(size_t max_in_flight) : max_in_flight_(max_in_flight) {}

  // Reader: waits for room; false once stopped.
  bool acquire_slot() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return stopped_ || in_flight_ < max_in_flight_; });
    if (stopped_) return false;
    ++in_flight_;
    return true;
  }
  void post(ChunkResult r) {
    std::lock_guard lock(mu_);
    const uint64_t seq = r.sequence;
    ready_.emplace(seq, std::move(r));
    cv_.notify_all();
  }
  // Writer: the result with this sequence number.
  ChunkResult take(uint64_t seq) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return ready_.count(seq) > 0; });
    ChunkResult r = std::move(ready_[seq]);
    ready_.erase(seq);
    return r;
  }
  void release_slot() {
    std::lock_guard lock(mu_);
    --in_flight_;
    cv_.notify_all();
  }
  void stop() {
    std::lock_guard lock(mu_);
    stopped_ = true;
    cv_.notify_all();
  }
  bool stopped() {
    std::lock_guard lock(mu_);
    return stopped_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, ChunkResult> ready_;
  size_t max_in_flight_, in_flight_ = 0;
  bool stopped_ = false;
};

struct Job {
  const PreprocessOptions& options;
  const std::vector<std::string>& files;
  bool append_eod;
  int32_t eod;
};

// Parses and tokenizes every line of a chunk.
ChunkResult process_chunk(const Job& job, const LineChunk& chunk, Tokenizer& tokenizer, JsonLineParser& parser) {
  const auto& keys = job.options.json_keys;
  ChunkResult r;
  r.sequence = chunk.sequence;
  r.first_global = chunk.first_global;
  r.bytes = chunk.data.size();
  r.keys.resize(keys.size());
  std::vector<JsonField> fields;
  std::string error;
  const std::string& file = job.files[chunk.file];
  size_t pos = 0;
  uint64_t line = chunk.first_line;
  while (pos < chunk.data.size()) {
    const size_t nl = chunk.data.find('\n', pos);
    const std::string_view text(chunk.data.data() + pos, nl + 1 - pos);
    pos = nl + 1;
    auto where = [&] { return fmt::format("--input '{}': line {}", file, line); };
    if (!parser.parse(text, fields, error)) {
      r.error = fmt::format("{}: not valid JSON as Python's json.loads reads it: {}", where(), error);
      return r;
    }
    for (size_t k = 0; k < keys.size(); ++k) {
      const JsonField& f = fields[k];
      if (f.kind == JsonField::missing) {
        r.error = fmt::format("{} has no key '{}' (--json-keys)", where(), keys[k]);
        return r;
      }
      if (f.kind == JsonField::other) {
        r.error = fmt::format("{}: the value of '{}' is {}; it must be a string (or a list of strings)", where(), keys[k],
                              f.other_type);
        return r;
      }
      if (f.lone_surrogate) {
        r.error = fmt::format("{}: the value of '{}' holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff), "
                              "which no tokenizer can encode", where(), keys[k]);
        return r;
      }
      KeyTokens& out = r.keys[k];
      const size_t doc_start = out.tokens.size();
      int32_t sequences = 0;
      for (const std::string& sentence : f.strings) {
        const size_t before = out.tokens.size();
        try {
          tokenizer.encode(sentence, out.tokens);
        } catch (const Error& e) {
          r.error = fmt::format("{}, key '{}': {}", where(), keys[k], e.what());
          return r;
        }
        const size_t n = out.tokens.size() - before;
        if (n > 0) {  // Megatron drops empty sentences
          out.sequence_lengths.push_back(static_cast<int32_t>(n));
          ++sequences;
        }
      }
      if (job.append_eod && out.tokens.size() > doc_start) {
        out.tokens.push_back(job.eod);
        ++out.sequence_lengths.back();
      }
      out.sequences_per_document.push_back(sequences);
    }
    ++r.documents;
    ++line;
  }
  return r;
}

std::string output_prefix(const std::string& prefix, const std::string& key) { return prefix + "_" + key + "_document"; }

void remove_dataset(const std::string& prefix) {
  std::error_code ec;
  fs::remove(bin_path_of(prefix), ec);
  fs::remove(idx_path_of(prefix), ec);
}

}  // namespace

std::vector<std::string> resolve_preprocess_inputs(const std::string& input, int partitions) {
  std::error_code ec;
  if (partitions <= 1) {
    if (!fs::is_regular_file(input, ec)) fail("--input '{}': no such file", input);
    return {input};
  }
  glob_t g{};
  const int rc = ::glob(input.c_str(), GLOB_NOSORT, nullptr, &g);
  std::vector<std::string> files;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) files.emplace_back(g.gl_pathv[i]);
  globfree(&g);
  if (files.empty()) fail("--input '{}' matches no file (with --partitions > 1 it is a glob pattern)", input);
  for (const std::string& f : files)
    if (!fs::is_regular_file(f, ec)) fail("--input '{}' matches '{}', which is not a regular file", input, f);
  return files;
}

PreprocessResult preprocess_data(const PreprocessOptions& o, std::ostream& log) {
  if (o.json_keys.empty()) fail("--json-keys needs at least one key");
  for (size_t i = 0; i < o.json_keys.size(); ++i)
    for (size_t j = i + 1; j < o.json_keys.size(); ++j)
      if (o.json_keys[i] == o.json_keys[j]) fail("--json-keys lists '{}' twice", o.json_keys[i]);
  if (o.workers < 1) fail("--workers must be at least 1 (got {})", o.workers);
  if (o.partitions < 1) fail("--partitions must be at least 1 (got {})", o.partitions);
  if (o.workers % o.partitions != 0)
    fail("--workers {} is not divisible by --partitions {} (Megatron's rule: workers are split evenly across "
         "partitions)", o.workers, o.partitions);
  if (o.log_interval < 1) fail("--log-interval must be at least 1 (got {})", o.log_interval);
  if (o.output_prefix.empty()) fail("--output-prefix is required");
  const fs::path out_dir = fs::path(o.output_prefix).parent_path();
  std::error_code ec;
  if (!out_dir.empty() && !fs::is_directory(out_dir, ec))
    fail("--output-prefix '{}': directory '{}' does not exist", o.output_prefix, out_dir.string());

  const std::vector<std::string> files = resolve_preprocess_inputs(o.input, o.partitions);
  // Opens every input (refusing formats it cannot read) before any output file is created.
  LineChunkReader reader(files, o.chunk_bytes);
  const auto startup = Clock::now();
  std::unique_ptr<Tokenizer> tokenizer = build_tokenizer(o.tokenizer);
  const int32_t eod = o.append_eod ? tokenizer->eod() : -1;
  const TokenDType dtype = optimal_token_dtype(tokenizer->vocab_size());
  for (const std::string& f : files) log << "Opening " << f << "\n";
  log << fmt::format("Tokenizer {}: vocab size {}, writing {}{}\n", tokenizer->name(), tokenizer->vocab_size(),
                     dtype == TokenDType::uint16 ? "uint16" : "int32", o.append_eod ? fmt::format(", eod {}", eod) : "");

  // Round-robin partitions reorder documents: partition p's documents come before p+1's. Each
  // partition is written to Megatron's intermediate prefix <prefix>_<p>_<key>_document and then
  // concatenated. Contiguous partitions (--keep-sequential-samples) keep the input order.
  const int parts = (o.partitions > 1 && !o.keep_sequential_samples) ? o.partitions : 1;
  const size_t nkeys = o.json_keys.size();
  std::vector<std::string> final_prefixes, part_prefixes;  // part_prefixes[p * nkeys + k]
  for (const std::string& key : o.json_keys) final_prefixes.push_back(output_prefix(o.output_prefix, key));
  // The outputs are written under temporary names (<final prefix>.tmp.<pid>.bin/.idx) and renamed
  // into place only once every input has been read to its end, so a failed or killed run never
  // leaves a partial dataset under the final names (nor replaces an earlier complete one).
  std::vector<std::string> temp_prefixes;
  for (const std::string& f : final_prefixes) temp_prefixes.push_back(fmt::format("{}.tmp.{}", f, ::getpid()));
  std::vector<std::unique_ptr<IndexedDatasetBuilder>> builders;
  for (int p = 0; p < parts; ++p)
    for (size_t k = 0; k < nkeys; ++k) {
      const std::string prefix = parts == 1 ? temp_prefixes[k] : output_prefix(fmt::format("{}_{}", o.output_prefix, p), o.json_keys[k]);
      part_prefixes.push_back(prefix);
      builders.push_back(std::make_unique<IndexedDatasetBuilder>(prefix, dtype));
    }
  auto cleanup = [&] {
    builders.clear();
    for (const auto& p : part_prefixes) remove_dataset(p);
    for (const auto& p : temp_prefixes) remove_dataset(p);
  };
  log << fmt::format("Time to startup: {:.3f} s\n",
                     std::chrono::duration<double>(Clock::now() - startup).count());
  log.flush();

  const Job job{o, files, o.append_eod, eod};
  std::vector<std::unique_ptr<Tokenizer>> tokenizers;
  tokenizers.push_back(std::move(tokenizer));
  for (int w = 1; w < o.workers; ++w) tokenizers.push_back(tokenizers[0]->clone());

  WorkQueue queue;
  ResultBoard board(2 * static_cast<size_t>(o.workers) + 2);
  std::exception_ptr reader_error;
  size_t reader_error_file = 0;  // the file being read when reader_error was raised
  std::thread reader_thread([&] {
    uint64_t count = 0;
    try {
      LineChunk chunk;
      while (board.acquire_slot()) {
        if (!reader.next(chunk)) break;
        ++count;
        queue.push(std::move(chunk));
        chunk = LineChunk{};
      }
    } catch (...) {
      reader_error = std::current_exception();
      reader_error_file = reader.current_file();
    }
    queue.close();
    ChunkResult end;
    end.sequence = count;
    end.end = true;
    board.post(std::move(end));
  });
  std::vector<std::thread> workers;
  for (int w = 0; w < o.workers; ++w) {
    workers.emplace_back([&, w] {
      JsonLineParser parser(o.json_keys);
      while (auto chunk = queue.pop()) {
        ChunkResult r;
        if (!board.stopped()) {
          try {
            r = process_chunk(job, *chunk, *tokenizers[w], parser);
          } catch (const std::exception& e) {
            r = ChunkResult{};
            r.error = fmt::format("--input '{}' near line {}: {}", files[chunk->file], chunk->first_line, e.what());
          }
        }
        r.sequence = chunk->sequence;
        r.file = chunk->file;
        board.post(std::move(r));
      }
    });
  }
  auto join_all = [&] {
    reader_thread.join();
    for (auto& t : workers) t.join();
  };

  // Writer: results in input order.
  PreprocessResult result;
  const auto start = Clock::now();
  int64_t next_log = o.log_interval;
  std::string failure;
  std::optional<size_t> failed_file;  // set when the failure is in the text of this input file
  try {
    for (uint64_t seq = 0;; ++seq) {
      ChunkResult r = board.take(seq);
      if (r.end) {
        if (reader_error) std::rethrow_exception(reader_error);
        break;
      }
      std::vector<size_t> token_pos(nkeys, 0), length_pos(nkeys, 0);
      for (int64_t d = 0; d < r.documents; ++d) {
        const size_t part = parts == 1 ? 0 : static_cast<size_t>((r.first_global + d) % parts);
        for (size_t k = 0; k < nkeys; ++k) {
          const KeyTokens& kt = r.keys[k];
          const int32_t nseq = kt.sequences_per_document[d];
          int64_t ntok = 0;
          for (int32_t q = 0; q < nseq; ++q) ntok += kt.sequence_lengths[length_pos[k] + q];
          builders[part * nkeys + k]->add_document(
              std::span<const int32_t>(kt.tokens.data() + token_pos[k], static_cast<size_t>(ntok)),
              std::span<const int32_t>(kt.sequence_lengths.data() + length_pos[k], static_cast<size_t>(nseq)));
          token_pos[k] += static_cast<size_t>(ntok);
          length_pos[k] += static_cast<size_t>(nseq);
        }
      }
      result.documents += r.documents;
      result.bytes += r.bytes;
      while (result.documents >= next_log) {
        const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
        log << fmt::format("Processed {} documents ({:.1f} docs/s, {:.2f} MB/s).\n", next_log, next_log / elapsed,
                           result.bytes / elapsed / 1024 / 1024);
        log.flush();
        next_log += o.log_interval;
      }
      if (!r.error.empty()) {
        failure = r.error;
        failed_file = r.file;
        break;
      }
      board.release_slot();
    }
  } catch (const std::exception& e) {
    failure = e.what();
  }
  if (!failure.empty()) {
    board.stop();
    queue.close();
    join_all();
    // Text that fails in compressed input may be damage inflated to wrong text, detected only
    // further on (at the latest by the member's CRC-32 at its end): the damage is what is reported
    // (LineChunkReader::check_rest_of_file).
    if (failed_file) {
      try {
        if (reader_error && reader_error_file == *failed_file) std::rethrow_exception(reader_error);
        if (!reader_error && reader.inside_compressed(*failed_file)) {
          log << fmt::format("Checking the rest of {} (a damaged compressed stream can inflate to invalid text) ...\n",
                             files[*failed_file]);
          log.flush();
          reader.check_rest_of_file(*failed_file);
        }
      } catch (const std::exception& e) {
        failure = e.what();
      }
    }
    cleanup();
    // One line: the cause, and that no dataset was left (an earlier one under the same names is kept).
    throw Error(fmt::format("{}; nothing was written", failure));
  }
  join_all();

  try {
    for (auto& b : builders) b->finalize();
    if (parts > 1) {
      for (size_t k = 0; k < nkeys; ++k) {
        IndexedDatasetBuilder merged(temp_prefixes[k], dtype);
        for (int p = 0; p < parts; ++p) merged.add_index(part_prefixes[p * nkeys + k]);
        merged.finalize();
      }
      builders.clear();
      for (const auto& p : part_prefixes) remove_dataset(p);
    }
    // Into place: the .bin first, so a reader that finds the new .idx finds its .bin too.
    for (size_t k = 0; k < nkeys; ++k) {
      for (const auto& path_of : {bin_path_of, idx_path_of}) {
        std::error_code rename_error;
        fs::rename(path_of(temp_prefixes[k]), path_of(final_prefixes[k]), rename_error);
        if (rename_error)
          fail("{}: cannot rename into place as {}: {}", path_of(temp_prefixes[k]), path_of(final_prefixes[k]),
               rename_error.message());
      }
    }
  } catch (...) {
    cleanup();
    throw;
  }
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  result.output_prefixes = final_prefixes;
  return result;
}

}  // namespace mt
