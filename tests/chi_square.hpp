// Two-sample chi-square tests of token frequencies: is a speculative strategy's output
// distributed like plain sampling's at each position?
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace specmesh::test {

// Two-sample chi-square statistic (homogeneity) over tokens seen at least 10 times in all;
// rarer tokens are pooled into one category. Returns {statistic, degrees of freedom}.
inline std::pair<double, int> homogeneity(const std::map<int32_t, int>& a, const std::map<int32_t, int>& b) {
  std::map<int32_t, std::pair<double, double>> cat;
  for (auto [t, c] : a) cat[t].first += c;
  for (auto [t, c] : b) cat[t].second += c;
  std::vector<std::pair<double, double>> cells;
  std::pair<double, double> rare{0, 0};
  for (auto& [t, ab] : cat) {
    if (ab.first + ab.second >= 10) cells.push_back(ab);
    else rare.first += ab.first, rare.second += ab.second;
  }
  if (rare.first + rare.second > 0) cells.push_back(rare);
  double na = 0, nb = 0;
  for (auto& c : cells) na += c.first, nb += c.second;
  double chi2 = 0;
  for (auto& c : cells) {
    const double tot = c.first + c.second;
    const double ea = tot * na / (na + nb), eb = tot * nb / (na + nb);
    chi2 += (c.first - ea) * (c.first - ea) / ea + (c.second - eb) * (c.second - eb) / eb;
  }
  return {chi2, int(cells.size()) - 1};
}

// Upper 0.1% point of chi-square with k degrees of freedom (Wilson-Hilferty approximation).
inline double chi2_critical(int k) {
  const double z = 3.0902;  // standard normal upper 0.1%
  const double h = 2.0 / (9.0 * k);
  return k * std::pow(1 - h + z * std::sqrt(h), 3);
}

}  // namespace specmesh::test
