#include "runtime.h"

#include <string>

namespace fla {
namespace {

struct Driver {
  decltype(&cuGetErrorString) getErrorString = nullptr;
  decltype(&cuCtxGetCurrent) ctxGetCurrent = nullptr;
  decltype(&cuModuleLoadData) moduleLoadData = nullptr;
  decltype(&cuModuleGetFunction) moduleGetFunction = nullptr;
  decltype(&cuFuncSetAttribute) funcSetAttribute = nullptr;
  decltype(&cuLaunchKernel) launchKernel = nullptr;
  decltype(&cuTensorMapEncodeTiled) tensorMapEncodeTiled = nullptr;
  std::string error;
};

template <typename F>
void fetch(const char* symbol, F* fn, std::string* error) {
  cudaDriverEntryPointQueryResult status;
  void* ptr = nullptr;
  cudaError_t err = cudaGetDriverEntryPointByVersion(symbol, &ptr, 12000, cudaEnableDefault, &status);
  if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || ptr == nullptr) {
    if (error->empty()) *error = std::string("CUDA driver entry point ") + symbol + " not found";
    return;
  }
  *fn = reinterpret_cast<F>(ptr);
}

const Driver& driver() {
  static const Driver d = [] {
    Driver d;
    fetch("cuGetErrorString", &d.getErrorString, &d.error);
    fetch("cuCtxGetCurrent", &d.ctxGetCurrent, &d.error);
    fetch("cuModuleLoadData", &d.moduleLoadData, &d.error);
    fetch("cuModuleGetFunction", &d.moduleGetFunction, &d.error);
    fetch("cuFuncSetAttribute", &d.funcSetAttribute, &d.error);
    fetch("cuLaunchKernel", &d.launchKernel, &d.error);
    fetch("cuTensorMapEncodeTiled", &d.tensorMapEncodeTiled, &d.error);
    return d;
  }();
  return d;
}

std::string describe(CUresult r, const char* what) {
  const char* msg = nullptr;
  if (driver().getErrorString) driver().getErrorString(r, &msg);
  return std::string(what) + " failed: " + (msg ? msg : "unknown CUDA error") + " (" + std::to_string(int(r)) + ")";
}

}  // namespace

CUfunction Kernel::get(std::string* error) {
  const Driver& d = driver();
  if (!d.error.empty()) {
    *error = d.error;
    return nullptr;
  }
  CUcontext ctx = nullptr;
  CUresult r = d.ctxGetCurrent(&ctx);
  if (r != CUDA_SUCCESS || ctx == nullptr) {
    *error = r != CUDA_SUCCESS ? describe(r, "cuCtxGetCurrent") : "no current CUDA context";
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [c, f] : loaded_)
    if (c == ctx) return f;
  CUmodule module;
  if ((r = d.moduleLoadData(&module, cubin_)) != CUDA_SUCCESS) {
    *error = describe(r, "cuModuleLoadData");
    return nullptr;
  }
  CUfunction fn;
  if ((r = d.moduleGetFunction(&fn, module, name_)) != CUDA_SUCCESS) {
    *error = describe(r, "cuModuleGetFunction");
    return nullptr;
  }
  // Always: with the program's static shared memory (TileLang's mbarriers) a dynamic size just
  // under 48 KB still needs the opt-in (x_a_exact at K = 64: 48 KB + 8 bytes failed to launch).
  if (smem_ > 0 &&
      (r = d.funcSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(smem_))) != CUDA_SUCCESS) {
    *error = describe(r, "cuFuncSetAttribute(max dynamic shared memory)");
    return nullptr;
  }
  loaded_.emplace_back(ctx, fn);
  return fn;
}

std::string encode_tiled(CUtensorMap* map, int dtype, int rank, void* ptr, const uint64_t* dims, const uint64_t* strides,
                         const uint32_t* box, const uint32_t* element_strides, int interleave, int swizzle, int l2,
                         int oob_fill) {
  const Driver& d = driver();
  if (!d.error.empty()) return d.error;
  CUresult r = d.tensorMapEncodeTiled(map, CUtensorMapDataType(dtype), cuuint32_t(rank), ptr, dims, strides + 1, box,
                                      element_strides, CUtensorMapInterleave(interleave), CUtensorMapSwizzle(swizzle),
                                      CUtensorMapL2promotion(l2), CUtensorMapFloatOOBfill(oob_fill));
  return r == CUDA_SUCCESS ? "" : describe(r, "cuTensorMapEncodeTiled");
}

std::string launch(Kernel& kernel, const int64_t grid[3], const int64_t block[3], CUstream stream, void** params) {
  for (int i = 0; i < 3; ++i) {
    if (grid[i] == 0) return "";  // nothing to do
    if (grid[i] < 0 || grid[i] > (i == 0 ? 2147483647LL : 65535LL))
      return "grid dimension " + std::to_string(i) + " = " + std::to_string(grid[i]) + " is out of range";
  }
  std::string error;
  CUfunction fn = kernel.get(&error);
  if (fn == nullptr) return error;
  CUresult r = driver().launchKernel(fn, unsigned(grid[0]), unsigned(grid[1]), unsigned(grid[2]), unsigned(block[0]),
                                     unsigned(block[1]), unsigned(block[2]), kernel.dynamic_smem(), stream, params,
                                     nullptr);
  return r == CUDA_SUCCESS ? "" : describe(r, "cuLaunchKernel");
}

}  // namespace fla
