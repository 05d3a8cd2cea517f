// backend: tensor-parallel ranks over MPI (Open MPI), compiled in when CMake finds MPI.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace fantai {

// Empty when this build has MPI; otherwise why not (printed by CMake too).
std::string mpi_unavailable_reason();
// Empty when this build can join CUDA devices of several ranks: it has the CUDA backend, CMake
// found NCCL's header, and libnccl opens (it is loaded at run time, on first use: this
// call loads it); otherwise why not. The collectives then run over NCCL and MPI still starts the
// ranks and carries the step's host data (cuda/cuda_backend.h).
std::string nccl_unavailable_reason();

// The libraries a CUDA build opens at run time instead of linking ("nccl", "cublaslt"), each
// opened by this call if not yet: the file, the version it reports, or why it is unusable (the
// error of a build without its header, or without CUDA, starts "this build"). Here beside
// nccl_unavailable_reason, which gives the "nccl" entry's error where the header was found.
struct RuntimeLibrary {
  std::string name;
  std::string path;
  int64_t version = 0;
  std::string error;
};
std::vector<RuntimeLibrary> cuda_runtime_libraries();

// This process's rank in the MPI world mpirun started (0 when it was not started by mpirun).
// Initialises MPI when built with it.
int mpi_world_rank();

// Rank 0 of a group of `world_size` ranks. Started by mpirun with that many ranks: the MPI world
// (every rank runs the same command; ranks > 0 call mpi_join). Otherwise this process spawns
// world_size - 1 ranks running worker_argv (argv[0] the program) through MPI_Comm_spawn.
// timeout_s bounds every collective (the watchdog); on a miss the process fails loudly and exits.
std::shared_ptr<Communicator> mpi_connect(int world_size, const std::vector<std::string>& worker_argv,
                                          double timeout_s);
// A rank > 0: the group of the process that spawned this one, or the MPI world.
std::shared_ptr<Communicator> mpi_join(double timeout_s);
// A clean stop under mpirun: frees the group and calls MPI_Finalize, so mpirun sees a rank that
// finished (status 0). Does nothing when MPI was never started, a group failed (that path exits
// with status 70 on its own), never ran steps, or was spawned (MPI_Comm_spawn: no mpirun waits
// on its status). Finalize waits for the other ranks; when
// one has not finalized within timeout_s the process exits with status 70 instead of hanging.
// Returns whether MPI was finalized here.
bool mpi_finalize(double timeout_s);

}  // namespace fantai
