// What a stage takes on from its peers, and what it refuses at once (before any device job is
// queued or any KV cell claimed), so a peer that floods it cannot make it hold more than a
// bounded amount of work, memory or cache.
//
// Runs in flight: every run start, activation and cache operation a stage accepts holds a
// place until its device job is done (or dropped); a sender (the peer node it came from) holds
// at most `max_per_sender` places. What a real pipeline keeps in flight towards one stage:
// pipeinfer up to max_runs = 30 target runs (the most any strategy keeps), the head's prompt
// chunks (one run per 256 prompt tokens, launched together: 16 for a 4096-token context) and a
// few cache operations per run. The default, 1024, is far above that (a 200k-token prompt
// still fits) and bounds a flood to about 1024 small jobs per peer. One place per peer node,
// not per sender session: a peer has one session at a time, and a session id is the peer's to
// choose, so counting per session would let a peer open as many caps as it likes.
//
// Runs that can never be computed are refused too: fields of different lengths, no tokens,
// more tokens than the KV cache has cells, a token in no sequence, a negative position (its
// cell could never be removed again), and cache operations on sequences the cache does not
// have (a sequence set is 64 bits: ids 0..63; only a remove may name -1, "every sequence").
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "specmesh/messages/protocol.hpp"

namespace specmesh {

inline constexpr int kDefaultMaxRunsPerSender = 1024;

class RunAdmission {
 public:
  // Held by an accepted run's device job; destroying it gives the place back (any thread).
  class Place;
  using PlacePtr = std::shared_ptr<Place>;

  explicit RunAdmission(int max_per_sender = kDefaultMaxRunsPerSender);

  // A place for one more run from `from`, or null when it already holds max_per_sender.
  PlacePtr admit(const std::string& from);

  int max_per_sender() const;
  int in_flight(const std::string& from) const;
  int in_flight() const;  // every sender together

 private:
  struct Counts;
  std::shared_ptr<Counts> counts_;  // shared with the places, which may outlive this
};

// Why a run cannot be computed by a stage whose cache has `n_cells` cells, or "" when it can.
std::string run_problem(const RunStart& r, int n_cells);
// Why a list of cache operations names sequences the cache does not have, or "".
std::string kv_ops_problem(const std::vector<KvOp>& ops);

// The Error text of a refused run: "too many runs in flight (N) from 'peer': ...".
std::string too_many_runs(const std::string& from, int max_per_sender);

}  // namespace specmesh
