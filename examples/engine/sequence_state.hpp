#pragma once
// SequenceStateKeeper: a policy whose per-sequence state must follow a conversation from
// one turn's request to the next.
//
// Policies key their state by SeqId, and a resumed conversation is a new sequence (its
// pages, cached_len and position come back through Engine::add_sequence). Most state can
// be rebuilt from the pages, but some cannot: CompressorPolicy scores with the post-RoPE
// queries of the last `window` steps, which no page holds. Without them a resumed
// compressed sequence would wait `window` steps for a fresh window before compressing
// again, and then keep other tokens than an uninterrupted run. The conversation host
// (conversation_host.hpp: finish_turn / start_turn) asks a keeper for the state of the
// finishing request, stores it with the suspended conversation in the ConversationCache,
// and gives it to the next turn's sequence only when that turn continues the whole history
// (on any miss the sequence starts fresh, as a new one would).

#include <any>

#include "engine/engine.hpp"

namespace kvkit {
namespace engine {

/// Saves and restores a policy's state of one sequence across a suspend / resume.
class SequenceStateKeeper {
 public:
  virtual ~SequenceStateKeeper() = default;
  /// The policy's state of live sequence `seq` (copied; empty when it has none).
  virtual std::any save_sequence(SeqId seq) const = 0;
  /// Live sequence `seq`, which has not run a step yet, continues the sequence whose
  /// save_sequence() returned `state` (an empty state: nothing to restore). Throws
  /// kvkit::Error for a state this policy did not save or a sequence that already ran.
  virtual void restore_sequence(SeqId seq, const std::any& state) = 0;
  /// Host memory held by `state` (one this policy's save_sequence() returned; 0 for an
  /// empty one), so a cache keeping it can count it.
  virtual std::int64_t state_bytes(const std::any& state) const = 0;
};

}  // namespace engine
}  // namespace kvkit
