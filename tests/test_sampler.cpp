#include <gtest/gtest.h>

#include <cmath>

#include "specmesh/model/sampler.hpp"

using namespace specmesh;

TEST(Sampler, GreedyTakesTheFirstMaximum) {
  const std::vector<float> l = {0.1f, 3.0f, -1.0f, 3.0f};
  Sampler s({.temperature = 0});
  EXPECT_EQ(s.sample(l.data(), 4), 1);
  auto d = s.distribution(l.data(), 4);
  EXPECT_EQ(d, (std::vector<float>{0, 1, 0, 0}));
}

TEST(Sampler, DistributionIsTemperatureSoftmax) {
  const std::vector<float> l = {1.0f, 2.0f, 0.5f};
  Sampler s({.temperature = 0.5f});
  auto d = s.distribution(l.data(), 3);
  double z = std::exp(2.0) + std::exp(4.0) + std::exp(1.0);
  EXPECT_NEAR(d[0], std::exp(2.0) / z, 1e-6);
  EXPECT_NEAR(d[1], std::exp(4.0) / z, 1e-6);
  EXPECT_NEAR(d[2], std::exp(1.0) / z, 1e-6);
}

TEST(Sampler, FiltersTopKTopPMinP) {
  const std::vector<float> l = {0.0f, 1.0f, 2.0f, 3.0f, 4.0f};
  auto nonzero = [](const std::vector<float>& d) {
    int n = 0;
    for (float p : d) n += p > 0;
    return n;
  };
  EXPECT_EQ(nonzero(Sampler({.temperature = 1, .top_k = 2}).distribution(l.data(), 5)), 2);
  // Probabilities ~ .64 .24 .09 .03 .01: top-p 0.8 keeps two, min-p 0.1 keeps three.
  EXPECT_EQ(nonzero(Sampler({.temperature = 1, .top_p = 0.8f}).distribution(l.data(), 5)), 2);
  EXPECT_EQ(nonzero(Sampler({.temperature = 1, .min_p = 0.1f}).distribution(l.data(), 5)), 3);
  auto d = Sampler({.temperature = 1, .top_k = 3}).distribution(l.data(), 5);
  EXPECT_NEAR(d[2] + d[3] + d[4], 1.0, 1e-6);
  EXPECT_EQ(d[0], 0.0f);
}

TEST(Sampler, SeededAndReproducible) {
  std::vector<float> l(100);
  for (int i = 0; i < 100; ++i) l[i] = std::sin(i * 0.37f) * 3;
  auto draw = [&](uint64_t seed) {
    Sampler s({.temperature = 1.0f, .seed = seed});
    std::vector<int32_t> v;
    for (int i = 0; i < 50; ++i) v.push_back(s.sample(l.data(), 100));
    return v;
  };
  EXPECT_EQ(draw(7), draw(7));
  EXPECT_NE(draw(7), draw(8));
}

// Frequencies of 40,000 draws match the distribution (chi-square, 4 dof, p ~ 0.001 bound).
TEST(Sampler, DrawsFollowTheDistribution) {
  const std::vector<float> l = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f};
  Sampler s({.temperature = 1.0f, .seed = 123});
  auto d = s.distribution(l.data(), 5);
  std::vector<int> count(5);
  const int n = 40000;
  for (int i = 0; i < n; ++i) ++count[s.sample(l.data(), 5)];
  double chi2 = 0;
  for (int k = 0; k < 5; ++k) chi2 += std::pow(count[k] - n * d[k], 2) / (n * d[k]);
  EXPECT_LT(chi2, 18.47);
}
