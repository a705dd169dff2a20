// Facts about this machine that the command line needs, found without linking CUDA: how many
// NVIDIA GPUs a worker would see (for --nproc-per-node gpu/auto) and the CPU count.
#pragma once

#include <filesystem>
#include <optional>
#include <string>

namespace ctorch::launcher {

// Physical NVIDIA GPUs: entries of <procRoot>/driver/nvidia/gpus, else /dev/nvidiaN devices.
int countNvidiaDevices(const std::filesystem::path& procRoot = "/proc",
                       const std::filesystem::path& devRoot = "/dev");

// What CUDA would expose given CUDA_VISIBLE_DEVICES (nullopt: unset) and `physical` devices:
// entries are parsed in order and the list ends at the first invalid one, as CUDA does.
int visibleGpuCount(int physical, const std::optional<std::string>& cudaVisibleDevices);

int onlineCpuCount();

// Whether `python` (an executable path) finds the torch package: importlib's find_spec, which
// locates it without importing it (tens of milliseconds, not the seconds `import torch` takes).
bool pythonFindsTorch(const std::string& python);
std::string hostName();

} // namespace ctorch::launcher
