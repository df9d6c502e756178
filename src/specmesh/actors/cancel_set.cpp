#include "specmesh/actors/cancel_set.hpp"

namespace specmesh {

size_t CancelSet::find(uint64_t run) const {
  for (size_t i = home(run);; i = (i + 1) & (kSlots - 1)) {
    if (t_->slots[i] == run) return i;
    if (t_->slots[i] == 0) return kSlots;
  }
}

void CancelSet::erase(uint64_t run) {
  size_t hole = find(run);
  if (hole == kSlots) return;
  // Moves back every later id of the probe run that may no longer be found past the hole.
  for (size_t j = (hole + 1) & (kSlots - 1); t_->slots[j] != 0; j = (j + 1) & (kSlots - 1)) {
    const size_t k = home(t_->slots[j]);
    // The id at j stays when its home lies cyclically in (hole, j].
    const bool stays = hole < j ? (hole < k && k <= j) : (hole < k || k <= j);
    if (stays) continue;
    t_->slots[hole] = t_->slots[j];
    hole = j;
  }
  t_->slots[hole] = 0;
}

void CancelSet::add(uint64_t run) {
  if (run == 0) return;
  std::lock_guard lk(mu_);
  if (find(run) != kSlots) return;
  if (size_ == kKeep) erase(t_->ring[next_]);  // the oldest goes
  else ++size_;
  t_->ring[next_] = run;
  next_ = (next_ + 1) % kKeep;
  size_t i = home(run);
  while (t_->slots[i] != 0) i = (i + 1) & (kSlots - 1);
  t_->slots[i] = run;
}

bool CancelSet::contains(uint64_t run) const {
  if (run == 0) return false;
  std::lock_guard lk(mu_);
  return find(run) != kSlots;
}

}  // namespace specmesh
