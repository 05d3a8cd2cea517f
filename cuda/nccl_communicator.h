// cuda: tensor-parallel collectives between GPU ranks over NCCL. Declared in every CUDA build;
// defined only when CMake found NCCL (FANTAI_WITH_NCCL), and only nccl_communicator.cu sees
// nccl.h. The registry calls these when a CUDA backend is made in a group of more than one rank.
#pragma once

#include <memory>

#include "backend/backend.h"

namespace fantai::cuda {

// This process's index among the group's ranks on its own host (the GPU it takes). Collective
// over `host`: every rank calls it at the same point.
int nccl_local_rank(Communicator& host);

// The communicator of a CUDA backend in `host`'s group: all-reduces and all-gathers of device
// memory run over NCCL on `stream` (the backend's cudaStream_t) on GPU `device`; host memory,
// broadcasts, rank and world size stay with `host` (MPI), which also bootstraps NCCL (rank 0's
// ncclUniqueId is broadcast over it). Collective over `host`. Every collective is polled against
// FANTAI_TP_TIMEOUT_S (5 s), as the MPI communicator's are; a miss or an NCCL error aborts the
// NCCL communicator and fails the process as the MPI path does.
std::shared_ptr<Communicator> create_nccl_communicator(std::shared_ptr<Communicator> host, int device,
                                                       void* stream);

}  // namespace fantai::cuda
