// Continuous batching: decode steps of several sessions that are ready at the same time go
// into the target's pipeline as one run, whose logits are split back per session.
//
// A session's step (a "part": its own run id, its batch with sequences already in the
// session's range) waits here while `max_in_flight` merged runs are outstanding (one per
// target stage keeps every stage busy); when one comes back, everything waiting leaves as the
// next run, up to max_rows rows, oldest first. A lone session therefore never waits: its step
// leaves at once, as it would without merging.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "specmesh/actors/run_ids.hpp"
#include "specmesh/messages/protocol.hpp"
#include "specmesh/model/batch.hpp"
#include "specmesh/transport/router.hpp"

namespace specmesh {

class RunMerger {
 public:
  using Owner = const void*;  // the session a part belongs to
  // Runs go to `first_node` as pipeline `role`.
  RunMerger(std::string role, std::string first_node, std::shared_ptr<Router> router, RunIds& ids, size_t max_rows,
            size_t max_in_flight);

  // A session's step; leaves with the next merged run.
  void add(Owner owner, uint64_t part, Batch batch);
  // Sends the owner's waiting parts now, as a run of their own (a cache operation of the
  // session must follow them, in order).
  void send_pending(Owner owner);
  bool has_pending(Owner owner) const;
  // Forgets a part: a waiting one never leaves, an outstanding one is not delivered; a run
  // whose every part is forgotten is cancelled in the pipeline. Returns whether it knew it.
  bool drop(Owner owner, uint64_t part);
  void drop_owner(Owner owner);
  // Sends what may leave now.
  void flush();
  // Forgets everything without cancelling (the pipeline's stages were replaced).
  void clear();

  struct Delivery {
    Owner owner;
    uint64_t part;
    Logits logits;  // rows renumbered to the part's batch
  };
  // A merged run's logits split per part still wanted; nullopt when `run` is not a merged run.
  std::optional<std::vector<Delivery>> split(uint64_t run, const Logits& logits);
  // The owners of an outstanding merged run (empty when it is not one), which forgets it.
  std::vector<Owner> take(uint64_t run);

  size_t in_flight() const { return sent_.size(); }
  uint64_t runs_sent() const { return runs_sent_; }
  uint64_t parts_sent() const { return parts_sent_; }

 private:
  struct Part {
    Owner owner;
    uint64_t part;
    Batch batch;
    size_t offset = 0;  // first row in the merged run
    bool dropped = false;
  };
  void send(std::vector<Part> parts);

  std::string role_, first_node_;
  std::shared_ptr<Router> router_;
  RunIds& ids_;
  size_t max_rows_, max_in_flight_;
  std::deque<Part> waiting_;
  std::map<uint64_t, std::vector<Part>> sent_;  // merged run -> its parts
  uint64_t runs_sent_ = 0, parts_sent_ = 0;
};

}  // namespace specmesh
