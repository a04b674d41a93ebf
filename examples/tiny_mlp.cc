#include "examples/tiny_mlp.h"

#include <algorithm>
#include <cmath>

namespace modelavg::examples {
namespace {

// A generator for one (purpose, rank, draw) stream, so that shards never share samples.
std::mt19937_64 Stream(uint64_t seed, uint64_t purpose, uint64_t rank, uint64_t draw) {
  std::seed_seq seq{seed, purpose, rank, draw};
  return std::mt19937_64(seq);
}

// log(1 + exp(z)), stable for large |z|.
double Softplus(double z) { return z > 0 ? z + std::log1p(std::exp(-z)) : std::log1p(std::exp(z)); }

}  // namespace

SyntheticTask::SyntheticTask(int features, int world_size, uint64_t seed)
    : features_(features), world_size_(world_size), seed_(seed) {
  std::mt19937_64 rng = Stream(seed, 1, 0, 0);
  std::normal_distribution<float> normal(0.f, 1.f);
  teacher_.resize(features);
  teacher_curve_.resize(features);
  for (float& v : teacher_) v = normal(rng);
  for (float& v : teacher_curve_) v = normal(rng);
  offsets_.resize(world_size);
  for (auto& offset : offsets_) {
    offset.resize(features);
    for (float& v : offset) v = 1.5f * normal(rng);
  }
}

float SyntheticTask::Label(const float* x, std::mt19937_64& rng) const {
  double linear = 0, curve = 0;
  for (int i = 0; i < features_; ++i) {
    linear += teacher_[i] * x[i];
    curve += teacher_curve_[i] * x[i];
  }
  const double score = linear / std::sqrt(features_) + std::sin(curve / std::sqrt(features_));
  std::normal_distribution<double> noise(0.0, 0.3);
  return score + noise(rng) > 0 ? 1.f : 0.f;
}

Dataset SyntheticTask::Shard(int rank, int64_t n, uint64_t draw) const {
  std::mt19937_64 rng = Stream(seed_, 2, static_cast<uint64_t>(rank), draw);
  std::normal_distribution<float> normal(0.f, 1.f);
  Dataset d;
  d.features = features_;
  d.x.resize(static_cast<size_t>(n) * features_);
  d.y.resize(static_cast<size_t>(n));
  const std::vector<float>& offset = offsets_[static_cast<size_t>(rank % world_size_)];
  for (int64_t i = 0; i < n; ++i) {
    float* row = &d.x[static_cast<size_t>(i) * features_];
    for (int j = 0; j < features_; ++j) row[j] = offset[j] + normal(rng);
    d.y[static_cast<size_t>(i)] = Label(row, rng);
  }
  return d;
}

Dataset SyntheticTask::Population(int64_t n_per_rank) const {
  Dataset all;
  all.features = features_;
  for (int r = 0; r < world_size_; ++r) {
    Dataset shard = Shard(r, n_per_rank, /*draw=*/1u << 30);  // never a training draw
    all.x.insert(all.x.end(), shard.x.begin(), shard.x.end());
    all.y.insert(all.y.end(), shard.y.begin(), shard.y.end());
  }
  return all;
}

TinyMlp::TinyMlp(int features, int hidden, uint64_t seed)
    : features_(features),
      hidden_(hidden),
      w1_(static_cast<size_t>(hidden) * features),
      b1_(hidden, 0.f),
      w2_(hidden),
      b2_(1, 0.f) {
  std::mt19937_64 rng = Stream(seed, 3, 0, 0);
  std::normal_distribution<float> w1_init(0.f, 1.f / std::sqrt(static_cast<float>(features)));
  std::normal_distribution<float> w2_init(0.f, 1.f / std::sqrt(static_cast<float>(hidden)));
  for (float& v : w1_) v = w1_init(rng);
  for (float& v : w2_) v = w2_init(rng);
}

double TinyMlp::Loss(const Dataset& data) const {
  double total = 0;
  std::vector<float> h(hidden_);
  for (int64_t i = 0; i < data.size(); ++i) {
    const float* x = &data.x[static_cast<size_t>(i) * features_];
    double logit = b2_[0];
    for (int k = 0; k < hidden_; ++k) {
      float a = b1_[k];
      for (int j = 0; j < features_; ++j) a += w1_[k * features_ + j] * x[j];
      logit += w2_[k] * std::tanh(a);
    }
    // BCE with logits: softplus(z) - y z.
    total += Softplus(logit) - data.y[static_cast<size_t>(i)] * logit;
  }
  return data.size() > 0 ? total / data.size() : 0.0;
}

double TinyMlp::SgdStep(const Dataset& data, int64_t first, int64_t count, float learning_rate) {
  std::vector<float> gw1(w1_.size(), 0.f), gb1(b1_.size(), 0.f), gw2(w2_.size(), 0.f);
  float gb2 = 0.f;
  std::vector<float> h(hidden_);
  double loss = 0;
  for (int64_t n = 0; n < count; ++n) {
    const int64_t i = (first + n) % data.size();
    const float* x = &data.x[static_cast<size_t>(i) * features_];
    const float y = data.y[static_cast<size_t>(i)];
    double logit = b2_[0];
    for (int k = 0; k < hidden_; ++k) {
      float a = b1_[k];
      for (int j = 0; j < features_; ++j) a += w1_[k * features_ + j] * x[j];
      h[k] = std::tanh(a);
      logit += w2_[k] * h[k];
    }
    loss += Softplus(logit) - y * logit;
    const float dlogit = static_cast<float>(1.0 / (1.0 + std::exp(-logit))) - y;
    gb2 += dlogit;
    for (int k = 0; k < hidden_; ++k) {
      gw2[k] += dlogit * h[k];
      const float da = dlogit * w2_[k] * (1.f - h[k] * h[k]);
      gb1[k] += da;
      for (int j = 0; j < features_; ++j) gw1[k * features_ + j] += da * x[j];
    }
  }
  const float scale = learning_rate / static_cast<float>(std::max<int64_t>(count, 1));
  for (size_t i = 0; i < w1_.size(); ++i) w1_[i] -= scale * gw1[i];
  for (size_t i = 0; i < b1_.size(); ++i) b1_[i] -= scale * gb1[i];
  for (size_t i = 0; i < w2_.size(); ++i) w2_[i] -= scale * gw2[i];
  b2_[0] -= scale * gb2;
  return count > 0 ? loss / count : 0.0;
}

}  // namespace modelavg::examples
