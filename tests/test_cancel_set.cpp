// The stages' set of cancelled runs: the newest CancelSet::kKeep ids, found whatever ids came
// and went before them, against a plain reference.
#include <gtest/gtest.h>

#include <deque>
#include <random>
#include <set>

#include "specmesh/actors/cancel_set.hpp"

using namespace specmesh;

TEST(CancelSet, HoldsTheNewestIdsAndForgetsTheOldest) {
  CancelSet s;
  std::deque<uint64_t> order;
  std::set<uint64_t> held;
  std::mt19937_64 rng(3);
  std::vector<uint64_t> seen;
  for (int i = 0; i < 60000; ++i) {
    // Random ids, small ones (clustered in the table: 1, 2, 3, ...), and repeats of held ones.
    uint64_t id = i % 3 == 0 ? rng() : i % 3 == 1 ? uint64_t(i) : (seen.empty() ? 1 : seen[rng() % seen.size()]);
    s.add(id);
    if (!held.count(id)) {
      held.insert(id);
      order.push_back(id);
      if (order.size() > CancelSet::kKeep) {
        held.erase(order.front());
        order.pop_front();
      }
    }
    seen.push_back(id);
    if (i % 97 == 0)
      for (int k = 0; k < 50; ++k) {
        const uint64_t q = seen[rng() % seen.size()];
        ASSERT_EQ(s.contains(q), held.count(q) == 1) << "id " << q << " after " << i << " adds";
      }
  }
  for (uint64_t q : order) ASSERT_TRUE(s.contains(q));
  EXPECT_FALSE(s.contains(0));
  s.add(0);
  EXPECT_FALSE(s.contains(0)) << "0 is no run";
}
