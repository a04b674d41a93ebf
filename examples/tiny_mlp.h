// The demo's model and task: a one-hidden-layer MLP classifying synthetic points, with each rank's
// training shard drawn from its own region of the input space (non-IID shards, the setting where
// local SGD drifts and averaging matters).
#ifndef MODELAVG_EXAMPLES_TINY_MLP_H_
#define MODELAVG_EXAMPLES_TINY_MLP_H_

#include <cstdint>
#include <random>
#include <vector>

namespace modelavg::examples {

// Labelled points: `x` holds `size() * features` values, row-major.
struct Dataset {
  int features = 0;
  std::vector<float> x;
  std::vector<float> y;  // 0 or 1
  int64_t size() const { return static_cast<int64_t>(y.size()); }
};

// The task shared by every rank: a fixed nonlinear "teacher" labels the points, and shard r's
// inputs are centred on its own offset. Same seed: same task on every rank.
class SyntheticTask {
 public:
  SyntheticTask(int features, int world_size, uint64_t seed);

  // `n` training points of `rank`'s shard (`draw` picks which sample of the stream).
  Dataset Shard(int rank, int64_t n, uint64_t draw) const;
  // A test set with `n_per_rank` points from every rank's region: the whole population.
  Dataset Population(int64_t n_per_rank) const;

 private:
  float Label(const float* x, std::mt19937_64& rng) const;

  int features_;
  int world_size_;
  uint64_t seed_;
  std::vector<float> teacher_;               // features
  std::vector<float> teacher_curve_;         // features
  std::vector<std::vector<float>> offsets_;  // per rank, features
};

// f(x) = w2 . tanh(W1 x + b1) + b2, trained with binary cross-entropy on the logit.
class TinyMlp {
 public:
  // Weights from `seed` (use the same seed on every rank, as DDP's initial broadcast would).
  TinyMlp(int features, int hidden, uint64_t seed);

  // Mean loss over `data`.
  double Loss(const Dataset& data) const;
  // One SGD step on rows [first, first + count) of `data` (wrapping around); returns the
  // batch's mean loss before the step.
  double SgdStep(const Dataset& data, int64_t first, int64_t count, float learning_rate);

  // The parameter tensors, in a fixed order (the averager's input).
  std::vector<std::vector<float>*> parameters() { return {&w1_, &b1_, &w2_, &b2_}; }

 private:
  int features_;
  int hidden_;
  std::vector<float> w1_;  // hidden x features
  std::vector<float> b1_;  // hidden
  std::vector<float> w2_;  // hidden
  std::vector<float> b2_;  // 1
};

}  // namespace modelavg::examples

#endif  // MODELAVG_EXAMPLES_TINY_MLP_H_
