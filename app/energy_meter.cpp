#include "app/energy_meter.h"

#include <dlfcn.h>

#include "core/error.h"
#include "engine/straggler.h"

namespace mt {

namespace {

// The few NVML entry points used, declared by their documented C signatures (nvml.h): the
// library is found at run time, and CI machines without a GPU have neither it nor its header.
struct NvmlLib {
  using Device = void*;  // nvmlDevice_t
  using Return = int;    // nvmlReturn_t; NVML_SUCCESS = 0
  struct Utilization {   // nvmlUtilization_t
    unsigned int gpu, memory;
  };
  std::string flag;  // the flag that needs it, for messages
  void* lib = nullptr;
  Return (*init)() = nullptr;
  Return (*shutdown)() = nullptr;
  const char* (*error_string)(Return) = nullptr;
  Return (*handle_by_pci_bus_id)(const char*, Device*) = nullptr;
  Return (*total_energy)(Device, unsigned long long*) = nullptr;
  Return (*temperature)(Device, int, unsigned int*) = nullptr;  // NVML_TEMPERATURE_GPU = 0
  Return (*power_usage)(Device, unsigned int*) = nullptr;        // milliwatts
  Return (*utilization)(Device, Utilization*) = nullptr;
  Return (*clock_info)(Device, int, unsigned int*) = nullptr;    // NVML_CLOCK_SM = 1, MHz
  Device device = nullptr;
  bool initialized = false;

  template <class Fn>
  void bind(Fn& fn, const char* name) {
    fn = reinterpret_cast<Fn>(::dlsym(lib, name));
    if (fn == nullptr) fail("{}: the NVML library has no {} (driver too old?)", flag, name);
  }
  std::string text(Return r) const { return error_string ? error_string(r) : "error " + std::to_string(r); }
  // Opens the library and the GPU at pci_bus_id.
  NvmlLib(const std::string& needed_by, const std::string& pci_bus_id) : flag(needed_by) {
    lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr)
      fail("{} reads the GPU through NVML, but libnvidia-ml.so.1 (part of the NVIDIA driver) cannot be opened: {}; "
           "drop {} or install the driver's NVML library", flag, ::dlerror(), flag);
    bind(init, "nvmlInit_v2");
    bind(shutdown, "nvmlShutdown");
    bind(error_string, "nvmlErrorString");
    bind(handle_by_pci_bus_id, "nvmlDeviceGetHandleByPciBusId_v2");
    if (const Return r = init(); r != 0) fail("{}: nvmlInit failed: {}", flag, text(r));
    initialized = true;
    if (const Return r = handle_by_pci_bus_id(pci_bus_id.c_str(), &device); r != 0)
      fail("{}: NVML does not know the GPU at PCI bus id {}: {}", flag, pci_bus_id, text(r));
  }
  ~NvmlLib() {
    if (initialized) shutdown();
    if (lib) ::dlclose(lib);
  }
};

}  // namespace

struct EnergyMeter::Nvml : NvmlLib {
  using NvmlLib::NvmlLib;
};
struct GpuSensors::Nvml : NvmlLib {
  using NvmlLib::NvmlLib;
};

GpuSensors::GpuSensors(const std::string& pci_bus_id) : nvml_(new Nvml("--log-straggler", pci_bus_id)) {
  try {
    nvml_->bind(nvml_->temperature, "nvmlDeviceGetTemperature");
    nvml_->bind(nvml_->power_usage, "nvmlDeviceGetPowerUsage");
    nvml_->bind(nvml_->utilization, "nvmlDeviceGetUtilizationRates");
    nvml_->bind(nvml_->clock_info, "nvmlDeviceGetClockInfo");
  } catch (...) {
    delete nvml_;
    throw;
  }
}

GpuSensors::~GpuSensors() { delete nvml_; }

GpuReadings GpuSensors::read() {
  GpuReadings g;
  Nvml& n = *nvml_;
  unsigned int v = 0;
  if (n.temperature(n.device, 0, &v) == 0) g.temp_c = v;
  if (n.power_usage(n.device, &v) == 0) g.power_w = v / 1000.0;
  NvmlLib::Utilization u{};
  if (n.utilization(n.device, &u) == 0) g.util_pct = u.gpu;
  if (n.clock_info(n.device, 1, &v) == 0) g.clock_mhz = v;
  return g;
}

EnergyMeter::EnergyMeter(const std::string& pci_bus_id) : nvml_(new Nvml("--log-energy", pci_bus_id)) {
  try {
    Nvml& n = *nvml_;
    n.bind(n.total_energy, "nvmlDeviceGetTotalEnergyConsumption");
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
