// ctorch-snapshot: a snapshot file seen from outside a run (docs/snapshot.md).
//   ctorch-snapshot inspect FILE                what it holds (a snapshot or one shard), and its shards
//   ctorch-snapshot verify FILE                 exit 0 when it and all its shards are intact and belong together
//   ctorch-snapshot consolidate FILE -o OUT.pt  a sharded snapshot as one whole file (torch.load opens it; a
//                                               run without sharding resumes from it)
// Offline: no ranks, no model. Exit codes: 0 done, 1 the snapshot is not whole or not usable, 2 a bad
// command line or an output that cannot be written.
#include <ctorch/errors.hpp>
#include <ctorch/resilience.hpp>
#include <ctorch/sharded_snapshot.hpp>
#include <ctorch/snapshot.hpp>
#include <ctorch/version.hpp>

#include <CLI/CLI.hpp>

#include <ctime>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>

namespace fs = std::filesystem;

namespace {

constexpr int kExitOk = 0;
constexpr int kExitNotWhole = 1;
constexpr int kExitUsage = 2;

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string utc(std::chrono::system_clock::time_point t) {
  const std::time_t seconds = std::chrono::system_clock::to_time_t(t);
  std::tm parts{};
  gmtime_r(&seconds, &parts);
  std::ostringstream os;
  os << std::put_time(&parts, "%Y-%m-%d %H:%M:%S UTC");
  return os.str();
}

std::string count(std::int64_t n) {
  std::ostringstream os;
  if (n >= 1000000) os << std::fixed << std::setprecision(2) << static_cast<double>(n) / 1e6 << " M";
  else if (n >= 1000) os << std::fixed << std::setprecision(1) << static_cast<double>(n) / 1e3 << " k";
  else os << n;
  return os.str();
}

// A file that is one rank's shard (not a snapshot of its own): its rank.
std::optional<std::int64_t> shardRank(const ctorch::Snapshot& s) {
  if (!s.userState.contains("zero_rank") || !s.userState.at("zero_rank").isInt()) return std::nullopt;
  return s.userState.at("zero_rank").toInt();
}

std::string point(const ctorch::Snapshot& s) { return ctorch::describeProgress(s.epochsRun, s.stepInEpoch, s.globalStep); }

void describeModel(const ctorch::Snapshot& s, std::ostream& out) {
  std::int64_t elements = 0;
  for (const auto& e : s.modelState) elements += e.value().numel();
  out << "  model:         " << s.modelState.size() << " entries, " << count(elements) << " elements\n";
  std::size_t withState = 0;
  if (s.optimizerState.contains("state") && s.optimizerState.at("state").isGenericDict())
    withState = s.optimizerState.at("state").toGenericDict().size();
  if (s.optimizerType.empty()) out << "  optimizer:     none\n";
  else out << "  optimizer:     " << s.optimizerType << ", state for " << withState << " parameters\n";
}

// Prints what `s` is; returns whether it is whole (every shard there and of this save).
bool describe(const ctorch::Snapshot& s, std::ostream& out) {
  const auto& h = s.header;
  out << s.source.string() << ": ctorch snapshot (format " << h.formatVersion << "), written " << utc(h.createdAt)
      << " by " << (h.ctorchVersion.empty() ? "an unknown ctorch" : h.ctorchVersion) << "\n";
  if (const auto rank = shardRank(s)) {
    out << "  a shard:       rank " << *rank << " of " << h.worldSize << ", of the snapshot of " << point(s) << "\n"
        << "  save:          " << (h.saveId.empty() ? "(no id: written before save ids)" : h.saveId) << "\n"
        << "  run:           " << h.modelName << ", configuration " << h.configHash.substr(0, 16) << "\n"
        << "  (inspect the snapshot itself to see all its shards)\n";
    return true;
  }
  out << "  run:           " << h.modelName << ", world size " << h.worldSize << "\n"
      << "  point:         " << point(s) << "\n"
      << "  save:          " << (h.saveId.empty() ? "(no id: written before save ids)" : h.saveId) << "\n"
      << "  configuration: " << h.configHash.substr(0, 16) << "\n";
  for (const auto& [key, value] : h.config) out << "    " << key << " = " << value << "\n";
  const ctorch::SnapshotSharding sharding = ctorch::shardingOf(s);
  out << "  sharding:      " << ctorch::toString(sharding) << "\n";
  if (sharding != ctorch::SnapshotSharding::kFullyShardedModel && sharding != ctorch::SnapshotSharding::kPipelineStages)
    describeModel(s, out);
  if (sharding == ctorch::SnapshotSharding::kNone) return true;
  const auto shards = ctorch::findSnapshotShards(s);
  bool whole = true;
  out << "  shards:        " << shards.size() << "\n";
  for (const auto& shard : shards) {
    out << "    rank " << shard.rank << ": " << shard.file.string();
    if (shard.usable) out << "  ok\n";
    else out << "  NOT USABLE: " << shard.problem << "\n";
    whole = whole && shard.usable;
  }
  if (whole) {
    const ctorch::Snapshot consolidated = ctorch::consolidateSnapshot(s);
    out << "  whole state (as consolidate writes it):\n";
    describeModel(consolidated, out);
  }
  out << "  verdict:       " << (whole ? "complete and consistent" : "incomplete: a run resumes from an older snapshot") << "\n";
  return whole;
}

ctorch::Snapshot load(const fs::path& file) {
  if (!fs::exists(file)) throw UsageError("no such file: " + file.string());
  return ctorch::loadSnapshot(file);
}

int inspect(const fs::path& file) {
  const ctorch::Snapshot s = load(file);
  return describe(s, std::cout) ? kExitOk : kExitNotWhole;
}

int verify(const fs::path& file) {
  const ctorch::Snapshot s = load(file);
  if (shardRank(s)) {
    std::cout << file.string() << ": ok (an intact shard; verify its snapshot to check them all)\n";
    return kExitOk;
  }
  bool whole = true;
  for (const auto& shard : ctorch::findSnapshotShards(s))
    if (!shard.usable) {
      std::cout << file.string() << ": rank " << shard.rank << "'s shard is not usable: " << shard.problem << "\n";
      whole = false;
    }
  if (whole) (void)ctorch::consolidateSnapshot(s);  // every shard's content read and fitted together
  if (whole) std::cout << file.string() << ": ok (" << ctorch::toString(ctorch::shardingOf(s)) << ", " << point(s) << ")\n";
  return whole ? kExitOk : kExitNotWhole;
}

// Why `output` would land on a file of `file`'s own snapshot set, or nothing. The set is every name
// derived from its slot (docs/snapshot.md's file names: the slot "snapshot.pt", its previous ones
// ".1" ..., its epoch slot "snapshot-epoch.pt", the lock, the shard folders "<file>.shards/", old shard
// names, temporaries) in the snapshot's folder, and any file that is one of its shards under another
// name (a hard link): --force replaces the output, so writing there would destroy what it reads.
std::optional<std::string> insideSnapshotSet(const fs::path& file, const fs::path& output) {
  std::error_code ec;
  const fs::path dir = fs::weakly_canonical(fs::absolute(file).parent_path(), ec);
  if (ec) return std::nullopt;
  const fs::path out = fs::weakly_canonical(fs::absolute(output), ec);
  if (ec) return std::nullopt;
  std::string slot = file.filename().string();
  if (const auto dot = slot.rfind('.'); dot != std::string::npos && dot + 1 < slot.size() &&
                                        slot.find_first_not_of("0123456789", dot + 1) == std::string::npos)
    slot.resize(dot);  // "snapshot.pt.2": its slot is snapshot.pt
  const fs::path slotPath = fs::path(slot);
  const std::string epoch = slotPath.stem().string() + "-epoch" + slotPath.extension().string();
  const fs::path relative = out.lexically_relative(dir);
  if (!relative.empty() && *relative.begin() != ".." && relative.is_relative()) {
    const std::string first = relative.begin()->string();
    for (const std::string& name : {slot, epoch})
      if (first == name || first.rfind(name + ".", 0) == 0)
        return "-o " + output.string() + " is inside the snapshot's own set (" + (dir / first).string() +
               "): name a file outside it";
  }
  std::vector<fs::path> members{file};
  try {
    for (const auto& shard : ctorch::snapshotShardFiles(file)) members.push_back(shard);
  } catch (const std::exception&) {
  }
  for (const auto& member : members)
    if (fs::equivalent(member, output, ec))
      return "-o " + output.string() + " is " + member.string() + ", a file of the snapshot: name another file";
  return std::nullopt;
}

int consolidate(const fs::path& file, const fs::path& output, bool force) {
  if (output.empty()) throw UsageError("consolidate needs -o OUT.pt");
  std::error_code ec;
  if (fs::equivalent(file, output, ec)) throw UsageError("-o " + output.string() + " is the snapshot itself: name another file");
  if (auto problem = insideSnapshotSet(file, output)) throw UsageError(*problem);
  if (fs::exists(fs::symlink_status(output)) && !force)
    throw UsageError("-o " + output.string() + " exists: name another file, or add --force to replace it");
  if (auto problem = ctorch::snapshotPathProblem(output, "-o")) throw UsageError(*problem);
  const ctorch::Snapshot s = load(file);
  if (shardRank(s)) throw UsageError(file.string() + " is one rank's shard: consolidate the snapshot it belongs to");
  const bool pipeline = ctorch::shardingOf(s) == ctorch::SnapshotSharding::kPipelineStages;
  ctorch::Snapshot whole = ctorch::consolidateSnapshot(s);
  ctorch::SnapshotSlotOptions slot;
  slot.path = output;
  slot.keepPrevious = 0;
  try {
    ctorch::saveSnapshot(whole, slot);
  } catch (const std::exception& e) {
    throw UsageError("cannot write " + output.string() + ": " + e.what());
  }
  std::size_t params = 0;
  if (whole.optimizerState.contains("state") && whole.optimizerState.at("state").isGenericDict())
    params = whole.optimizerState.at("state").toGenericDict().size();
  std::cout << "wrote " << output.string() << ": the whole model (" << whole.modelState.size() << " entries) and "
            << (whole.optimizerType.empty() ? std::string("no optimizer state")
                                            : whole.optimizerType + " state for " + std::to_string(params) + " parameters")
            << " of " << point(whole)
            << (pipeline ? "; torch.load opens it; its names are the pipeline's sequence's (\"3.weight\": a torch.nn.Sequential "
                           "of the same layers loads it)\n"
                         : "; torch.load opens it, and a run without sharding resumes from it\n");
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ctorch-snapshot: inspect, verify or consolidate a ctorch snapshot (docs/snapshot.md)", "ctorch-snapshot"};
  app.set_version_flag("--version", ctorch::versionString());
  app.require_subcommand(1);
  fs::path inspectFile, verifyFile, consolidateFile, output;
  bool force = false;
  auto* inspectCmd = app.add_subcommand("inspect", "what a snapshot (or one shard) holds, and whether its shards are all there");
  inspectCmd->add_option("FILE", inspectFile, "a snapshot file or a shard file")->required();
  auto* verifyCmd = app.add_subcommand("verify", "exit 0 when the snapshot and all its shards are intact and of one save");
  verifyCmd->add_option("FILE", verifyFile, "a snapshot file")->required();
  auto* consolidateCmd =
      app.add_subcommand("consolidate", "a sharded snapshot (ZeRO-1, FSDP, parameter server) as one whole snapshot file");
  consolidateCmd->add_option("FILE", consolidateFile, "a snapshot file")->required();
  consolidateCmd->add_option("-o,--output", output, "the file to write")->required();
  consolidateCmd->add_flag("--force", force, "replace OUT if it exists");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? kExitOk : kExitUsage;
  }
  try {
    if (*inspectCmd) return inspect(inspectFile);
    if (*verifyCmd) return verify(verifyFile);
    return consolidate(consolidateFile, output, force);
  } catch (const UsageError& e) {
    std::cerr << "ctorch-snapshot: error: " << e.what() << std::endl;
    return kExitUsage;
  } catch (const ctorch::SnapshotError& e) {  // damaged, foreign, incompatible, shards missing
    std::cerr << "ctorch-snapshot: " << e.what() << std::endl;
    return kExitNotWhole;
  } catch (const std::exception& e) {
    std::cerr << "ctorch-snapshot: error: " << ctorch::errorMessage(e) << std::endl;
    return kExitNotWhole;
  }
}
