// A CUDA device that is not there, for a CPU build of torch (parallel/simulation/fake_cuda.py builds and loads this).
//
// Fake tensors (FakeTensorMode) already carry device "cuda" without storage; what a CPU build lacks is the
// runtime torch asks about such a device:
//  - a device guard for DeviceType::CUDA (current device, streams, events: every op on a CUDA tensor enters one),
//    c10's own FakeGuardImpl, which keeps the current device in a field and makes events no-ops;
//  - the CUDA hooks (at::detail::getCUDAHooks()), asked by the autograd engine and at::getAccelerator() whether
//    CUDA exists. torch creates the hooks once, the first time they are asked for, which `import torch` does:
//    so this library must be loaded before torch is imported (parallel/simulation/fake_cuda.load_shim, a fresh interpreter).
// No kernel ever runs on this device: a real (non-fake) CUDA tensor would have no allocator and fails.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace {
using FakeCUDAGuard = c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>;
C10_REGISTER_GUARD_IMPL(CUDA, FakeCUDAGuard);

constexpr c10::DeviceIndex kDevices = c10::impl::kFakeGuardImplMaxDevices;

struct FakeCUDAHooks final : at::CUDAHooksInterface {
  explicit FakeCUDAHooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return kDevices; }
  int getNumGPUs() const override { return kDevices; }
  c10::DeviceIndex current_device() const override { return FakeCUDAGuard::getDeviceIndex(); }
  c10::DeviceIndex getCurrentDevice() const override { return FakeCUDAGuard::getDeviceIndex(); }
  void setCurrentDevice(c10::DeviceIndex device) const override { FakeCUDAGuard::setDeviceIndex(device); }
  void deviceSynchronize(c10::DeviceIndex) const override {}
};
}  // namespace

namespace at {
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, FakeCUDAHooks);
}

// The self-test's question: did torch create its hooks from this registration (loaded in time)?
extern "C" int megazoo_fake_cuda_hooks_active() { return at::detail::getCUDAHooks().hasCUDA() ? 1 : 0; }
