// engine: tensor parallelism across processes: rank 0 sends each step's batch, ranks > 0 run it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/block_manager.h"
#include "model/kv_cache.h"
#include "model/model.h"

namespace fantai::engine {

// Rank 0, once the KV pool is sized: every rank makes the same pool (1/N of each block: its KV
// heads) so block tables mean the same everywhere, and all ranks check they hold the same model
// and options; a mismatch is refused on every rank.
// num_blocks: one count per KV kind (KVCache::kind_windows order).
// swap_slots: host swap slots per kind (each rank keeps its heads' share of every swapped block).
void tp_handshake_leader(model::Model& m, const std::vector<int32_t>& num_blocks, int32_t block_size,
                         DType kv_dtype, int32_t swap_slots);
// Rank 0, each step before its forward: the batch's metadata and the step's block copies.
void tp_send_step(model::Model& m, const model::ForwardBatch& fb, const std::vector<BlockCopy>& block_copies);
// Rank 0: block copies of a step without a forward.
void tp_send_copies(model::Model& m, const std::vector<BlockCopy>& block_copies);
// Rank 0, from Engine::release_memory: each rank returns the pages of the same KV block runs
// (kind, first block, count) to the OS, as rank 0 just did with its share.
void tp_send_release(model::Model& m, const std::vector<int32_t>& runs);
// Rank 0: the ranks > 0 leave their loop (the engine is going away).
// Sent once per group, and only to ranks that are in their loop; tp_stop_group also from the
// process's exit (rank 0 only; a no-op elsewhere).
void tp_send_stop(model::Model& m);
void tp_stop_group(Communicator& comm);
// A rank > 0: handshake, then one forward per step on its share until rank 0 stops it. The
// logits stay on rank 0 (the lm_head is replicated), so this rank stops at the last layer.
void run_tp_worker(const std::shared_ptr<model::Model>& m);

}  // namespace fantai::engine
