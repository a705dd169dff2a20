// Time to save and load snapshots of a given size, and where it goes (pickling, digest, disk).
//   build/bench/snapshot/snapshot_bench [--mb 256] [--dir /tmp] [--repeat 3]
// Model: one linear layer holding the requested megabytes of float32, SGD with momentum (so the
// file is about twice the model) - the shape matters little, the bytes do.
#include "snapshot/digest.hpp"
#include "ctorch/snapshot.hpp"

#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <unistd.h>

namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

template <typename Fn>
double best(int repeat, Fn&& fn) {
  double t = 1e30;
  for (int i = 0; i < repeat; ++i) {
    const auto a = Clock::now();
    fn();
    t = std::min(t, seconds(a, Clock::now()));
  }
  return t;
}

} // namespace

int main(int argc, char** argv) {
  int mb = 256, repeat = 3;
  std::filesystem::path dir = std::filesystem::temp_directory_path();
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--mb") mb = std::stoi(argv[i + 1]);
    else if (flag == "--dir") dir = argv[i + 1];
    else if (flag == "--repeat") repeat = std::stoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown flag %s (use --mb N --dir D --repeat R)\n", flag.c_str());
      return 2;
    }
  }
  torch::set_num_threads(1);
  const std::int64_t outFeatures = static_cast<std::int64_t>(mb) * 256;  // 1024 inputs x 4 bytes
  torch::nn::Linear model(1024, outFeatures);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (auto& p : model->parameters()) p.mutable_grad() = torch::ones_like(p);
  opt.step();

  const auto work = dir / ("ctorch-snapshot-bench-" + std::to_string(::getpid()));
  std::filesystem::create_directories(work);
  ctorch::SnapshotSlotOptions slot;
  slot.path = work / "snapshot.pt";
  slot.keepPrevious = 1;

  ctorch::SnapshotIdentity id{"bench", 1, {{"mb", std::to_string(mb)}}};
  ctorch::Snapshot snap;
  const double capture = best(repeat, [&] { snap = ctorch::captureSnapshot({model.ptr().get(), &opt, nullptr}, id, {}); });
  std::vector<char> bytes;
  const double encode = best(repeat, [&] { bytes = ctorch::encodeSnapshot(snap); });
  c10::IValue top = torch::jit::pickle_load(bytes);
  const double digest = best(repeat, [&] { ctorch::contentDigest(top); });  // over the same content
  std::size_t written = 0;
  const double save = best(repeat, [&] { written = ctorch::saveSnapshot(snap, slot); });
  const double decode = best(repeat, [&] { ctorch::decodeSnapshot(bytes, slot.path); });
  const double load = best(repeat, [&] { ctorch::loadSnapshot(slot.path); });
  std::filesystem::remove_all(work);

  const double fileMb = static_cast<double>(written) / (1 << 20);
  std::printf("snapshot of %.0f MiB (model %d MiB + SGD momentum), best of %d, 1 thread, %s\n",
              fileMb, mb, repeat, dir.c_str());
  std::printf("  %-42s %8.3f s\n", "captureSnapshot (copies)", capture);
  std::printf("  %-42s %8.3f s  (%.0f MiB/s)\n", "encodeSnapshot (pickle + digest)", encode, fileMb / encode);
  std::printf("  %-42s %8.3f s  (%.0f MiB/s)\n", "  of which contentDigest", digest, fileMb / digest);
  std::printf("  %-42s %8.3f s\n", "  the rest: pickling and zip (difference)", encode - digest);
  std::printf("  %-42s %8.3f s  (%.0f MiB/s)\n", "saveSnapshot (encode + fsync'ed write)", save, fileMb / save);
  std::printf("  %-42s %8.3f s  (%.0f MiB/s)\n", "decodeSnapshot (CRC + unpickle + digest)", decode, fileMb / decode);
  std::printf("  %-42s %8.3f s  (%.0f MiB/s)\n", "loadSnapshot (read + decode)", load, fileMb / load);
  return 0;
}
