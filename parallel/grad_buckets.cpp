#include "parallel/grad_buckets.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "core/error.h"

namespace mt {
namespace {

constexpr int64_t kParamAlignment = 64;   // elements
constexpr int64_t kBucketAlignment = 128;  // elements, combined with DP by lcm

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace

std::optional<int64_t> resolve_ddp_bucket_size(std::optional<int64_t> ddp_bucket_size,
                                               std::optional<int> ddp_num_buckets, bool overlap_grad_reduce,
                                               int dp_size, int64_t num_parameters) {
  if (ddp_bucket_size && *ddp_bucket_size <= 0) fail("--ddp-bucket-size must be positive (got {})", *ddp_bucket_size);
  if (ddp_num_buckets && *ddp_num_buckets <= 0) fail("--ddp-num-buckets must be positive (got {})", *ddp_num_buckets);
  if (!overlap_grad_reduce) return std::nullopt;
  if (ddp_num_buckets) return std::max<int64_t>(1, num_parameters / *ddp_num_buckets);
  if (ddp_bucket_size) return *ddp_bucket_size;
  return std::max<int64_t>(40000000, int64_t{1000000} * dp_size);
}

GradBufferPlan plan_grad_buffer(const std::vector<GradParam>& params, int dp_size,
                                std::optional<int64_t> bucket_size) {
  MT_CHECK(dp_size >= 1, "data-parallel size {}", dp_size);
  MT_CHECK(!bucket_size || *bucket_size > 0, "bucket size {}", *bucket_size);
  const int64_t bucket_multiple = std::lcm(int64_t{dp_size}, kBucketAlignment);

  GradBufferPlan plan;
  plan.dp_size = dp_size;
  plan.params.resize(params.size());

  int64_t cursor = 0;  // next free element
  GradBucket open;     // the bucket being filled; starts at open.offset
  int64_t last_end = 0;
  auto close_bucket = [&]() {
    open.numel_unpadded = last_end - open.offset;
    const int64_t end = open.offset + round_up(open.numel_unpadded, bucket_multiple);
    open.numel = end - open.offset;
    open.shards = dp_size;
    plan.buckets.push_back(std::move(open));
    open = GradBucket{};
    open.offset = end;
    cursor = end;
  };

  for (size_t i = 0; i < params.size(); ++i) {
    const GradParam& p = params[i];
    if (p.numel <= 0) fail("parameter '{}' has {} elements; every parameter needs at least one", p.name, p.numel);
    if ((p.own_bucket || (p.unit && i > 0 && params[i - 1].unit != p.unit)) && !open.params.empty()) close_bucket();
    cursor = round_up(cursor, kParamAlignment);
    plan.params[i] = {cursor, p.numel, static_cast<int>(plan.buckets.size())};
    open.params.push_back(static_cast<int>(i));
    cursor += p.numel;
    last_end = cursor;
    if ((bucket_size && cursor - open.offset >= *bucket_size) || p.own_bucket) close_bucket();
  }
  if (!open.params.empty()) close_bucket();
  plan.numel = plan.buckets.empty() ? 0 : plan.buckets.back().offset + plan.buckets.back().numel;
  return plan;
}

int64_t GradBufferPlan::shard_numel(int bucket) const { return buckets.at(bucket).numel / buckets.at(bucket).shards; }

int64_t GradBufferPlan::shard_offset(int bucket, int dp_rank) const {
  const int shards = buckets.at(bucket).shards;
  MT_CHECK(dp_rank >= 0 && dp_rank < shards, "dp rank {} of {}", dp_rank, shards);
  return buckets.at(bucket).offset + dp_rank * shard_numel(bucket);
}

std::vector<ShardSegment> GradBufferPlan::shard_segments(int bucket, int dp_rank) const {
  const int64_t lo = shard_offset(bucket, dp_rank), hi = lo + shard_numel(bucket);
  std::vector<ShardSegment> out;
  for (int i : buckets.at(bucket).params) {
    const ParamPlacement& p = params[i];
    const int64_t a = std::max(lo, p.offset), b = std::min(hi, p.offset + p.numel);
    if (a < b) out.push_back({i, a - p.offset, a - lo, b - a});
  }
  return out;
}

std::string describe(const GradBufferPlan& plan, const std::vector<GradParam>& params) {
  std::string out = fmt::format("gradient buffer: {} elements in {} bucket(s), DP {}", plan.numel,
                                plan.buckets.size(), plan.dp_size);
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    const GradBucket& k = plan.buckets[b];
    out += fmt::format("\n  bucket {}: offset {}, {} elements ({} padding), {} params, first {} last {}", b,
                       k.offset, k.numel, k.numel - k.numel_unpadded, k.params.size(),
                       params.at(k.params.front()).name, params.at(k.params.back()).name);
  }
  return out;
}

}  // namespace mt
