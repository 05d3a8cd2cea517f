// cuda: factory of the CUDA backend (built only with FANTAI_CUDA; see cuda/CMakeLists.txt).
#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"

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

}  // namespace fantai::cuda
