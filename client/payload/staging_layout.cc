#include "client/payload/staging_layout.h"

#include <algorithm>

namespace modelavg::client {

int32_t StagingCodeOf(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
      return kStageF64;
    case DType::kFloat16:
      return kStageF16;
    case DType::kBFloat16:
      return kStageBF16;
    default:
      return kStageF32;
  }
}

size_t StagingCodeSize(int32_t code) {
  return code == kStageF64 ? 8 : (code == kStageF32 ? 4 : 2);
}

int32_t StagingCode(absl::Span<const TensorView> tensors) {
  if (tensors.empty()) return kStageF32;
  bool same = true, any64 = false;
  for (const TensorView& t : tensors) {
    same = same && t.dtype == tensors[0].dtype;
    any64 = any64 || t.dtype == DType::kFloat64;
  }
  if (same) return tensors[0].dtype == DType::kBFloat16 ? kStageF32 : StagingCodeOf(tensors[0].dtype);
  return any64 ? kStageF64 : kStageF32;
}

bool IsZeroCopy(absl::Span<const TensorView> tensors) {
  if (tensors.empty()) return false;
  if (StagingCodeOf(tensors[0].dtype) != StagingCode(tensors)) return false;
  for (size_t i = 1; i < tensors.size(); ++i) {
    if (tensors[i].dtype != tensors[0].dtype ||
        static_cast<char*>(tensors[i].data) !=
            static_cast<char*>(tensors[i - 1].data) + tensors[i - 1].nbytes()) {
      return false;
    }
  }
  return true;
}

StagingLayout BuildStagingLayout(absl::Span<const TensorView> tensors, int32_t staging_code,
                                 bool pad) {
  StagingLayout out;
  const int64_t align =
      pad ? static_cast<int64_t>(kStagingAlignBytes / StagingCodeSize(staging_code)) : 1;
  int64_t offset = 0;
  for (size_t index = 0; index < tensors.size(); ++index) {
    const TensorView& t = tensors[index];
    offset = (offset + align - 1) / align * align;
    for (int64_t start = 0; start < t.numel; start += kStagingChunkElems) {
      StagingChunk c{};
      c.tensor = static_cast<char*>(t.data) + start * static_cast<int64_t>(DTypeSize(t.dtype));
      c.staging_offset = offset + start;
      c.numel = std::min(kStagingChunkElems, t.numel - start);
      c.tensor_dtype = StagingCodeOf(t.dtype);
      c.tensor_index = static_cast<int32_t>(index);
      out.chunks.push_back(c);
    }
    offset += t.numel;
  }
  out.elems = offset;
  return out;
}

std::vector<std::pair<int64_t, int64_t>> BucketRanges(int64_t elems, int64_t bucket_elems) {
  std::vector<std::pair<int64_t, int64_t>> out;
  if (elems <= 0) return out;
  if (bucket_elems <= 0) bucket_elems = elems;
  for (int64_t begin = 0; begin < elems; begin += bucket_elems) {
    out.emplace_back(begin, std::min(elems, begin + bucket_elems));
  }
  return out;
}

void SplitIntoBuckets(StagingLayout* layout, int64_t bucket_elems) {
  layout->buckets.clear();
  for (const auto& [begin, end] : BucketRanges(layout->elems, bucket_elems)) {
    StagingBucket b;
    b.begin = begin;
    b.end = end;
    layout->buckets.push_back(b);
  }
  std::vector<StagingChunk> out;
  out.reserve(layout->chunks.size() + layout->buckets.size());
  size_t k = 0;
  for (const StagingChunk& c : layout->chunks) {
    for (int64_t start = 0; start < c.numel;) {
      const int64_t at = c.staging_offset + start;
      while (layout->buckets[k].end <= at) ++k;
      StagingBucket& b = layout->buckets[k];
      const int64_t n = std::min(c.numel - start, b.end - at);
      StagingChunk piece = c;
      piece.tensor = static_cast<char*>(c.tensor) +
                     start * static_cast<int64_t>(StagingCodeSize(c.tensor_dtype));
      piece.staging_offset = at;
      piece.numel = n;
      if (b.num_chunks == 0) b.first_chunk = static_cast<int64_t>(out.size());
      ++b.num_chunks;
      out.push_back(piece);
      start += n;
    }
  }
  layout->chunks = std::move(out);
}

}  // namespace modelavg::client
