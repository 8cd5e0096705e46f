// One GPU's energy counter for --log-energy: NVML's nvmlDeviceGetTotalEnergyConsumption (the
// millijoules the board has used since the driver loaded; Volta and newer), as Megatron's
// EnergyMonitor reads it through pynvml. NVML is the driver's library (libnvidia-ml.so.1): it is
// opened at run time, so megatrain neither links against it nor needs it without --log-energy.
#pragma once

#include <string>

namespace mt {

struct GpuReadings;

// --log-straggler's readings of one GPU at a report: temperature (C), power (W), utilization (%)
// and SM clock (MHz), through NVML as torch.cuda's temperature(), power_draw(), utilization() and
// clock_rate() read them. A reading NVML refuses is 0 (Megatron would fail there).
class GpuSensors {
 public:
  explicit GpuSensors(const std::string& pci_bus_id);  // throws naming what is missing
  ~GpuSensors();
  GpuSensors(const GpuSensors&) = delete;
  GpuSensors& operator=(const GpuSensors&) = delete;
  GpuReadings read();

 private:
  struct Nvml;
  Nvml* nvml_ = nullptr;
};

class EnergyMeter {
 public:
  // The GPU with this PCI bus id ("0000:18:00.0", cudaDeviceGetPCIBusId's form). Throws mt::Error
  // naming what is missing: the library, the device, or an energy counter on it.
  explicit EnergyMeter(const std::string& pci_bus_id);
  ~EnergyMeter();
  EnergyMeter(const EnergyMeter&) = delete;
  EnergyMeter& operator=(const EnergyMeter&) = delete;

  // Joules since the driver loaded. A failed read returns the last value (Megatron does the same),
  // so a transient NVML error costs an interval's figure, not the run.
  double joules();

 private:
  struct Nvml;
  Nvml* nvml_ = nullptr;
  double last_ = 0;
};

}  // namespace mt
