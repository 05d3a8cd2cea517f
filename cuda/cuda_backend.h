// cuda: factory of the CUDA backend (built only with FANTAI_CUDA; see cuda/CMakeLists.txt).
#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"
#include "cuda/lazy_library.h"

namespace fantai::cuda {

// CUDA devices this process sees (0 without a driver or a GPU; never throws).
int device_count();
// Why no device is usable, for error messages ("" when one is).
std::string device_unavailable_reason();
// The backend on device `device` (default: CUDA_VISIBLE_DEVICES' first). Throws a clear
// InvalidArgument when no device is present.
std::shared_ptr<Backend> create_cuda_backend(int device = 0);
// The cudaStream_t a CUDA backend runs every op on (a device communicator's collectives go on it
// too, so they fall in order with the ops around them). Throws for a backend of another kind.
void* backend_stream(Backend& be);

// Tensor-parallel collectives between GPU ranks over NCCL (cuda_backend_nccl.cu): declared in
// every CUDA build, defined only when CMake found nccl.h (FANTAI_WITH_NCCL), and only that file
// sees it. The registry calls these when a CUDA backend is made in a group of more than one
// rank.

// Opens libnccl if not yet (FANTAI_NCCL_LIBRARY, where CMake found it, then the loader's path)
// and says from where, its ncclGetVersion, or why it cannot be used.
LibraryStatus nccl_library();

// This process's index among the group's ranks on its own host (the GPU it takes). Collective
// over `host`: every rank calls it at the same point.
int nccl_local_rank(Communicator& host);

// The communicator of a CUDA backend in `host`'s group: all-reduces and all-gathers of device
// memory run over NCCL on `stream` (the backend's cudaStream_t) on GPU `device`; host memory,
// broadcasts, rank and world size stay with `host` (MPI), which also bootstraps NCCL (rank 0's
// ncclUniqueId is broadcast over it). Collective over `host`. Every collective is polled against
// FANTAI_TP_TIMEOUT_S (5 s), as the MPI communicator's are; a miss or an NCCL error aborts the
// NCCL communicator and fails the process as the MPI path does.
// Throws InvalidArgument with nccl_library()'s error when NCCL cannot be loaded.
std::shared_ptr<Communicator> create_nccl_communicator(std::shared_ptr<Communicator> host, int device,
                                                       void* stream);

// Opens libcublasLt if not yet (FANTAI_CUBLASLT_LIBRARY, where CMake found it, then the loader's
// path; cublas_gemm.cu) and says from where, its cublasLtGetVersion, or why not (in a build
// without cublasLt.h too). linear() opens it at its first prefill-sized GEMM.
LibraryStatus cublaslt_library();

}  // namespace fantai::cuda
