// Shared runtime of the generated FFI handlers: driver entry points, per-context module loading,
// TMA descriptors and launches. Nothing here links libcuda: driver functions come through
// cudaGetDriverEntryPointByVersion. Every function reports failure as a message, never aborts.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace fla {

inline int64_t floordiv(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }
inline int64_t floormod(int64_t a, int64_t b) { return a - floordiv(a, b) * b; }

// A kernel embedded as a cubin; its module is loaded once per CUDA context, on first use.
class Kernel {
 public:
  Kernel(const unsigned char* cubin, const char* name, unsigned dynamic_smem)
      : cubin_(cubin), name_(name), smem_(dynamic_smem) {}
  // The function in the current context, or nullptr with `error` set.
  CUfunction get(std::string* error);
  unsigned dynamic_smem() const { return smem_; }

 private:
  const unsigned char* cubin_;
  const char* name_;
  unsigned smem_;
  std::mutex mu_;
  std::vector<std::pair<CUcontext, CUfunction>> loaded_;
};

// cuTensorMapEncodeTiled with TVM's argument order: `strides` has `rank` byte strides (the first,
// the element size, is skipped as the driver wants). Returns "" or an error message.
std::string encode_tiled(CUtensorMap* map, int dtype, int rank, void* ptr, const uint64_t* dims, const uint64_t* strides,
                         const uint32_t* box, const uint32_t* element_strides, int interleave, int swizzle, int l2,
                         int oob_fill);

// Launches `kernel` on `stream`. Returns "" or an error message.
std::string launch(Kernel& kernel, const int64_t grid[3], const int64_t block[3], CUstream stream, void** params);

}  // namespace fla
