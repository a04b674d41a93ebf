#include "client/payload/host_staging.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "client/base/half.h"

namespace modelavg::client {
namespace {

template <typename S, typename T>
void DivideIntoImpl(const T* in, int64_t n, S divisor, S* out) {
  if constexpr (std::is_same_v<S, T>) {
    if (static_cast<const void*>(in) == static_cast<const void*>(out)) {
      // In place: one pointer, so the loop vectorizes without an aliasing check.
      int exp = 0;
      if (std::frexp(divisor, &exp) == static_cast<S>(0.5)) {
        const S inv = static_cast<S>(1) / divisor;
        for (int64_t i = 0; i < n; ++i) out[i] *= inv;
      } else {
        for (int64_t i = 0; i < n; ++i) out[i] /= divisor;
      }
      return;
    }
  }
  int exp = 0;
  if (std::frexp(divisor, &exp) == static_cast<S>(0.5)) {
    const S inv = static_cast<S>(1) / divisor;
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<S>(in[i]) * inv;
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<S>(in[i]) / divisor;
  }
}

template <typename S>
void PackOne(const TensorView& t, S divisor, S* out) {
  const int64_t n = t.numel;
  switch (t.dtype) {
    case DType::kFloat32:
      DivideIntoImpl(static_cast<const float*>(t.data), n, divisor, out);
      break;
    case DType::kFloat64:
      DivideIntoImpl(static_cast<const double*>(t.data), n, divisor, out);
      break;
    case DType::kFloat16: {
      const uint16_t* in = static_cast<const uint16_t*>(t.data);
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<S>(HalfToFloat(in[i])) / divisor;
      break;
    }
    case DType::kBFloat16: {
      const uint16_t* in = static_cast<const uint16_t*>(t.data);
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<S>(BFloat16ToFloat(in[i])) / divisor;
      break;
    }
  }
}

template <typename S>
void UnpackOne(const S* in, const TensorView& t) {
  const int64_t n = t.numel;
  switch (t.dtype) {
    case DType::kFloat32: {
      float* out = static_cast<float*>(t.data);
      if constexpr (sizeof(S) == sizeof(float)) {
        std::memcpy(out, in, n * sizeof(float));
      } else {
        for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]);
      }
      break;
    }
    case DType::kFloat64: {
      double* out = static_cast<double*>(t.data);
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<double>(in[i]);
      break;
    }
    case DType::kFloat16: {
      uint16_t* out = static_cast<uint16_t*>(t.data);
      for (int64_t i = 0; i < n; ++i) out[i] = FloatToHalf(static_cast<float>(in[i]));
      break;
    }
    case DType::kBFloat16: {
      uint16_t* out = static_cast<uint16_t*>(t.data);
      for (int64_t i = 0; i < n; ++i) out[i] = FloatToBFloat16(static_cast<float>(in[i]));
      break;
    }
  }
}

// Calls fn(piece, offset) for each tensor's part of elements [begin, begin + n) of the
// concatenation: `piece` a view of that part, `offset` its place in [0, n).
template <typename Fn>
void ForEachPart(absl::Span<const TensorView> tensors, int64_t begin, int64_t n, Fn fn) {
  const int64_t end = begin + n;
  int64_t at = 0;
  for (const TensorView& t : tensors) {
    const int64_t lo = std::max(at, begin), hi = std::min(at + t.numel, end);
    if (lo < hi) {
      TensorView part = t;
      part.data = static_cast<char*>(t.data) + (lo - at) * static_cast<int64_t>(DTypeSize(t.dtype));
      part.numel = hi - lo;
      fn(part, lo - begin);
    }
    at += t.numel;
    if (at >= end) break;
  }
}

}  // namespace

void DivideInto(const float* in, int64_t n, float divisor, float* out) {
  DivideIntoImpl(in, n, divisor, out);
}
void DivideInto(const double* in, int64_t n, double divisor, double* out) {
  DivideIntoImpl(in, n, divisor, out);
}

void CopyToBackup(void* dst, const void* src, size_t bytes) {
#if defined(__SSE2__)
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  // Align the destination to 16 bytes, stream the middle, copy the tail.
  const size_t head = std::min(bytes, (16 - reinterpret_cast<uintptr_t>(d) % 16) % 16);
  std::memcpy(d, s, head);
  size_t i = head;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + i, s + i, bytes - i);
  _mm_sfence();
#else
  std::memcpy(dst, src, bytes);
#endif
}

DType StagingDType(absl::Span<const TensorView> tensors) {
  for (const TensorView& t : tensors) {
    if (t.dtype == DType::kFloat64) return DType::kFloat64;
  }
  return DType::kFloat32;
}

absl::StatusOr<int64_t> CheckHostTensors(absl::Span<const TensorView> tensors) {
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorView& t = tensors[i];
    if (absl::Status s = ValidateTensorView(i, t); !s.ok()) return s;
    if (!t.device.is_host()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", i, " is on ",
                                                     t.device.ToString(),
                                                     " but this communicator averages host "
                                                     "tensors: pass all-host or all-CUDA lists"));
    }
    total += t.numel;
  }
  return total;
}

void PackDivided(absl::Span<const TensorView> tensors, DType staging_dtype, double divisor,
                 void* staging, NonFiniteFinding* finding) {
  // The finite test reads each block right after the copy wrote it, from the cache.
  constexpr int64_t kBlock = 8192;
  const size_t elem = DTypeSize(staging_dtype);
  int64_t offset = 0;
  for (size_t index = 0; index < tensors.size(); ++index) {
    const TensorView& t = tensors[index];
    const bool check = finding != nullptr && !finding->found();
    for (int64_t begin = 0; begin < t.numel; begin += check ? kBlock : t.numel) {
      TensorView part = t;
      part.data = static_cast<char*>(t.data) + begin * DTypeSize(t.dtype);
      part.numel = std::min<int64_t>(t.numel - begin, check ? kBlock : t.numel);
      void* out = static_cast<char*>(staging) + (offset + begin) * elem;
      if (staging_dtype == DType::kFloat64) {
        PackOne<double>(part, divisor, static_cast<double*>(out));
      } else {
        PackOne<float>(part, static_cast<float>(divisor), static_cast<float*>(out));
      }
      if (check && !finding->found() && !AllFinite(out, staging_dtype, part.numel)) {
        finding->tensor = static_cast<int32_t>(index);
        finding->value = FirstNonFinite(out, staging_dtype, part.numel);
      }
    }
    offset += t.numel;
  }
}

void PackRange(absl::Span<const TensorView> tensors, DType staging_dtype, int64_t begin,
               int64_t n, void* staging) {
  ForEachPart(tensors, begin, n, [&](const TensorView& part, int64_t offset) {
    if (staging_dtype == DType::kFloat64) {
      PackOne<double>(part, 1.0, static_cast<double*>(staging) + begin + offset);
    } else {
      PackOne<float>(part, 1.0f, static_cast<float*>(staging) + begin + offset);
    }
  });
}

void UnpackRange(const void* src, DType staging_dtype, absl::Span<const TensorView> tensors,
                 int64_t begin, int64_t n) {
  ForEachPart(tensors, begin, n, [&](const TensorView& part, int64_t offset) {
    if (staging_dtype == DType::kFloat64) {
      UnpackOne<double>(static_cast<const double*>(src) + offset, part);
    } else {
      UnpackOne<float>(static_cast<const float*>(src) + offset, part);
    }
  });
}

void Unpack(const void* staging, DType staging_dtype, absl::Span<const TensorView> tensors) {
  int64_t offset = 0;
  for (const TensorView& t : tensors) {
    if (staging_dtype == DType::kFloat64) {
      UnpackOne<double>(static_cast<const double*>(staging) + offset, t);
    } else {
      UnpackOne<float>(static_cast<const float*>(staging) + offset, t);
    }
    offset += t.numel;
  }
}

}  // namespace modelavg::client
