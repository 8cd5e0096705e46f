#include "app/energy_meter.h"

#include <dlfcn.h>

#include "core/error.h"

namespace mt {

// The few NVML entry points used, declared by their documented C signatures (nvml.h): the
// library is found at run time, and CI machines without a GPU have neither it nor its header.
struct EnergyMeter::Nvml {
  using Device = void*;  // nvmlDevice_t
  using Return = int;    // nvmlReturn_t; NVML_SUCCESS = 0
  void* lib = nullptr;
  Return (*init)() = nullptr;
  Return (*shutdown)() = nullptr;
  const char* (*error_string)(Return) = nullptr;
  Return (*handle_by_pci_bus_id)(const char*, Device*) = nullptr;
  Return (*total_energy)(Device, unsigned long long*) = nullptr;
  Device device = nullptr;
  bool initialized = false;

  template <class Fn>
  void bind(Fn& fn, const char* name) {
    fn = reinterpret_cast<Fn>(::dlsym(lib, name));
    if (fn == nullptr) fail("--log-energy: the NVML library has no {} (driver too old?)", name);
  }
  std::string text(Return r) const { return error_string ? error_string(r) : "error " + std::to_string(r); }
  ~Nvml() {
    if (initialized) shutdown();
    if (lib) ::dlclose(lib);
  }
};

EnergyMeter::EnergyMeter(const std::string& pci_bus_id) : nvml_(new Nvml) {
  try {
    Nvml& n = *nvml_;
    n.lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (n.lib == nullptr)
      fail("--log-energy reads the GPU's energy counter through NVML, but libnvidia-ml.so.1 (part of the NVIDIA "
           "driver) cannot be opened: {}; drop --log-energy or install the driver's NVML library", ::dlerror());
    n.bind(n.init, "nvmlInit_v2");
    n.bind(n.shutdown, "nvmlShutdown");
    n.bind(n.error_string, "nvmlErrorString");
    n.bind(n.handle_by_pci_bus_id, "nvmlDeviceGetHandleByPciBusId_v2");
    n.bind(n.total_energy, "nvmlDeviceGetTotalEnergyConsumption");
    if (const Nvml::Return r = n.init(); r != 0) fail("--log-energy: nvmlInit failed: {}", n.text(r));
    n.initialized = true;
    if (const Nvml::Return r = n.handle_by_pci_bus_id(pci_bus_id.c_str(), &n.device); r != 0)
      fail("--log-energy: NVML does not know the GPU at PCI bus id {}: {}", pci_bus_id, n.text(r));
    unsigned long long mj = 0;
    if (const Nvml::Return r = n.total_energy(n.device, &mj); r != 0)
      fail("--log-energy: the GPU at {} reports no energy counter ({}); drop --log-energy", pci_bus_id, n.text(r));
    last_ = static_cast<double>(mj) / 1000.0;
  } catch (...) {
    delete nvml_;
    throw;
  }
}

EnergyMeter::~EnergyMeter() { delete nvml_; }

double EnergyMeter::joules() {
  unsigned long long mj = 0;
  if (nvml_->total_energy(nvml_->device, &mj) == 0) last_ = static_cast<double>(mj) / 1000.0;
  return last_;
}

}  // namespace mt
