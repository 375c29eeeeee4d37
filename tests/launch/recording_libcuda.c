/* A CUDA driver library that records launches instead of making them, built and loaded by
 * recording_driver.py (against the cuda.h Triton ships) and read through ctypes.
 *
 * cuLaunchKernel (what a PackedLaunch calls, csrc/launch/triton_launch.cpp) and cuLaunchKernelEx (what
 * Triton's own launcher calls) record the function, grid, block, shared memory, stream, launch
 * attributes and the parameters, as the driver reads them: as many as the kernel takes (set per
 * function with recording_set_param_count; a real driver reads it from the kernel image), 8 bytes
 * from each (a parameter's bytes first; Triton's launcher gives a narrower parameter fewer, so
 * compare only its own size). The other functions are what Triton's launcher and utilities link
 * against: they succeed and answer like an idle device. */
#include <cuda.h>
#include <stdint.h>
#include <string.h>

#define MAX_PARAMS 128
#define MAX_LAUNCHES 256
#define MAX_FUNCTIONS 1024

typedef struct {
  uint64_t function;
  unsigned grid[3];
  unsigned block[3];
  unsigned shared_bytes;
  uint64_t stream;
  int num_params; /* -1: a function whose parameter count was not set */
  int num_attrs;  /* launch attributes (cuLaunchKernelEx); 0 for cuLaunchKernel */
  unsigned char params[MAX_PARAMS * 8];
} RecordedLaunch;

static RecordedLaunch launches[MAX_LAUNCHES];
static int n_launches = 0; /* all launches since the last clear; the first MAX_LAUNCHES are kept */
static uint64_t functions[MAX_FUNCTIONS];
static int param_counts[MAX_FUNCTIONS];
static int n_functions = 0;
static CUcontext context = (CUcontext)1;
static CUresult launch_result = CUDA_SUCCESS;

void recording_set_param_count(uint64_t function, int count) {
  for (int i = 0; i < n_functions; ++i) {
    if (functions[i] == function) {
      param_counts[i] = count;
      return;
    }
  }
  if (n_functions < MAX_FUNCTIONS) {
    functions[n_functions] = function;
    param_counts[n_functions++] = count;
  }
}

void recording_set_context(void *ctx) { context = (CUcontext)ctx; }
void recording_set_launch_result(int result) { launch_result = (CUresult)result; }
void recording_clear(void) { n_launches = 0; }
int recording_count(void) { return n_launches; }
const RecordedLaunch *recording_launch(int i) { return i >= 0 && i < n_launches && i < MAX_LAUNCHES ? &launches[i] : 0; }

static CUresult record(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                       unsigned shared_bytes, CUstream stream, int num_attrs, void **params) {
  if (launch_result != CUDA_SUCCESS) return launch_result;
  if (n_launches < MAX_LAUNCHES) {
    RecordedLaunch *r = &launches[n_launches];
    r->function = (uint64_t)(uintptr_t)f;
    r->grid[0] = gx, r->grid[1] = gy, r->grid[2] = gz;
    r->block[0] = bx, r->block[1] = by, r->block[2] = bz;
    r->shared_bytes = shared_bytes;
    r->stream = (uint64_t)(uintptr_t)stream;
    r->num_attrs = num_attrs;
    r->num_params = -1;
    for (int i = 0; i < n_functions; ++i) {
      if (functions[i] == r->function) r->num_params = param_counts[i];
    }
    memset(r->params, 0, sizeof(r->params));
    for (int i = 0; i < r->num_params && i < MAX_PARAMS; ++i) memcpy(r->params + 8 * i, params[i], 8);
  }
  ++n_launches;
  return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared_bytes, CUstream stream, void **params, void **extra) {
  (void)extra;
  return record(f, gx, gy, gz, bx, by, bz, shared_bytes, stream, 0, params);
}

CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params, void **extra) {
  (void)extra;
  return record(f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX, config->blockDimY,
                config->blockDimZ, config->sharedMemBytes, config->hStream, (int)config->numAttrs, params);
}

CUresult cuCtxGetCurrent(CUcontext *pctx) {
  *pctx = context;
  return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char **name) {
  *name = error == CUDA_ERROR_ILLEGAL_ADDRESS ? "CUDA_ERROR_ILLEGAL_ADDRESS" : "CUDA_ERROR_UNKNOWN";
  return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult error, const char **text) {
  (void)error;
  *text = "recorded";
  return CUDA_SUCCESS;
}

/* What Triton's launchers and utilities link against besides. */
CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr pointer) {
  if (attribute == CU_POINTER_ATTRIBUTE_DEVICE_POINTER) *(CUdeviceptr *)data = pointer;
  return CUDA_SUCCESS;
}
CUresult cuCtxSetCurrent(CUcontext ctx) {
  context = ctx;
  return CUDA_SUCCESS;
}
CUresult cuCtxGetDevice(CUdevice *device) {
  *device = 0;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGet(CUdevice *device, int ordinal) {
  *device = ordinal;
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice device) {
  (void)device;
  *pctx = (CUcontext)1;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetAttribute(int *value, CUdevice_attribute attribute, CUdevice device) {
  (void)attribute, (void)device;
  *value = 0;
  return CUDA_SUCCESS;
}
CUresult cuDriverGetVersion(int *version) {
  *version = 13000;
  return CUDA_SUCCESS;
}
CUresult cuCtxGetLimit(size_t *value, CUlimit limit) {
  (void)limit;
  *value = 0;
  return CUDA_SUCCESS;
}
CUresult cuCtxSetLimit(CUlimit limit, size_t value) {
  (void)limit, (void)value;
  return CUDA_SUCCESS;
}
CUresult cuFuncGetAttribute(int *value, CUfunction_attribute attribute, CUfunction f) {
  (void)attribute, (void)f;
  *value = 0;
  return CUDA_SUCCESS;
}
CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute attribute, int value) {
  (void)f, (void)attribute, (void)value;
  return CUDA_SUCCESS;
}
CUresult cuFuncSetCacheConfig(CUfunction f, CUfunc_cache config) {
  (void)f, (void)config;
  return CUDA_SUCCESS;
}
CUresult cuModuleLoadData(CUmodule *module, const void *image) {
  (void)image;
  *module = (CUmodule)1;
  return CUDA_SUCCESS;
}
CUresult cuModuleGetFunction(CUfunction *f, CUmodule module, const char *name) {
  (void)module, (void)name;
  *f = (CUfunction)1;
  return CUDA_SUCCESS;
}
CUresult cuModuleUnload(CUmodule module) {
  (void)module;
  return CUDA_SUCCESS;
}
CUresult cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus *status) {
  (void)stream;
  *status = CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}
