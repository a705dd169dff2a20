// ResilientTraining after an in-place recovery (resilient_training_impl.hpp): the shard copies a
// sharded run keeps of its neighbour's state, a replacement joining with a peer's state, and the
// files reloaded when no copy is left.
#include "resilience/resilient_training_impl.hpp"

namespace ctorch {

void ResilientTraining::Impl::refreshShardCopy() {
  if (!copiesOn() || world == 1 || copiedAt == globalStep) return;
  const auto start = std::chrono::steady_clock::now();
  const std::vector<char> mine = torch::pickle_save(c10::IValue(state.rankShard()));
  heldCopyStep = -1;
  heldCopy = at::Tensor();
  heldCopy = ranks->passToNext(mine, copyLimit(), "the shard copies of global step " + std::to_string(globalStep));
  heldCopyStep = globalStep;
  copiedAt = globalStep;
  copySeconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Said once a step has run (an optimizer's state appears with its first step).
  if (globalStep > 0 && !copySizeSaid) {
    copySizeSaid = true;
    say("shard copies: each rank's shard (" + std::to_string((mine.size() + (1 << 19)) >> 20) +
        " MiB on rank 0) is sent to the next rank at every step and kept there for in-place recovery");
  }
}

ItemDict ResilientTraining::Impl::decodeShard(const at::Tensor& bytes, const std::string& what) {
  try {
    const auto* d = reinterpret_cast<const char*>(bytes.data_ptr<std::uint8_t>());
    const c10::IValue value = torch::pickle_load(std::vector<char>(d, d + bytes.numel()));
    if (!value.isGenericDict()) throw DistributedError(what + " is not a dict");
    ItemDict out = newItemDict();
    for (const auto& item : value.toGenericDict()) {
      if (!item.key().isString()) throw DistributedError(what + " has a key that is not a string");
      out.insert(item.key().toStringRef(), item.value());
    }
    return out;
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw DistributedError(what + " cannot be read: " + detail::messageOf(e));
  }
}

std::optional<ResumePoint> ResilientTraining::Impl::rejoinSharded(std::int64_t held, const ItemDict* entries) {
  const int w = world;
  const int prev = (rank + w - 1) % w;
  std::vector<double> v(2 * static_cast<std::size_t>(w), -3.0);
  v[static_cast<std::size_t>(rank)] = static_cast<double>(held);
  v[static_cast<std::size_t>(w + prev)] = held == -1 ? -1.0 : static_cast<double>(heldCopyStep);
  const auto all = ranks->allReduce(v, c10d::ReduceOp::MAX, "in-place recovery (where each rank's shard stands)");
  std::vector<int> lost;
  std::int64_t at = -1;
  bool anySurvivor = false;
  std::string why;
  for (int i = 0; i < w; ++i) {
    const auto step = static_cast<std::int64_t>(all[static_cast<std::size_t>(i)]);
    if (step == -1) {
      lost.push_back(i);
      continue;
    }
    anySurvivor = true;
    if (step < 0) {
      if (why.empty()) why = "rank " + std::to_string(i) + " had begun a step's update";
    } else if (at < 0) {
      at = step;
    } else if (step != at && why.empty()) {
      why = "the surviving ranks stand at different steps";
    }
  }
  if (!anySurvivor) return std::nullopt;
  if (why.empty())
    for (int f : lost) {
      const int holder = (f + 1) % w;
      if (all[static_cast<std::size_t>(holder)] == -1) {
        why = "rank " + std::to_string(f) + " and rank " + std::to_string(holder) + ", which kept its copy, were both lost";
        break;
      }
      if (static_cast<std::int64_t>(all[static_cast<std::size_t>(w + f)]) != at) {
        why = "rank " + std::to_string(holder) + "'s copy of rank " + std::to_string(f) + "'s shard is not of global step " +
              std::to_string(at) + " (the failure came between a step's update and its copy)";
        break;
      }
    }
  if (!why.empty()) return reloadFromFiles(why, held == -1);

  // Heal: the replicated state from the lowest survivor, each lost shard from its neighbour's copy.
  const auto exchange = recovery->exchangeState(*ranks, held >= 0 ? held : -1, stepInEpoch == 0 && epoch > 0, [&] {
    Snapshot mine = state.capture(identity(), progress(), currentKind() == Kind::kEpochComplete, entries, nullptr);
    mine.header.saveId = saveId();
    return encodeSnapshot(mine);
  });
  std::optional<ItemDict> myShard;
  std::string healed;
  for (int f : lost) {
    const int holder = (f + 1) % w;
    const std::string during = "in-place recovery (rank " + std::to_string(f) + "'s shard from rank " +
                               std::to_string(holder) + "'s copy)";
    if (rank == holder) ranks->sendTo(heldCopy, f, during);
    if (rank == f) {
      myShard = decodeShard(ranks->receiveFrom(holder, copyLimit(), during),
                            "rank " + std::to_string(holder) + "'s copy of rank " + std::to_string(f) + "'s shard");
    }
    healed += (healed.empty() ? "rank " : ", rank ") + std::to_string(f) + "'s shard from rank " + std::to_string(holder) +
              "'s copy";
  }
  if (held == -1) {
    if (!exchange || !exchange->received || !myShard)
      throw DistributedError("in-place recovery: rank " + std::to_string(rank) + " received no state to join with");
    const std::string& id = exchange->received->header.saveId;
    if (runId.empty() && id.find('-') != std::string::npos) runId = id.substr(0, id.find('-'));
    entries = &exchange->received->userState;
    resumeShards.clear();
    resumeShards[exchange->received->source] = {*myShard};
    restore(*exchange->received, /*rng=*/false);
    resumeShards.clear();
    saver->forgetSaved();  // nothing on disk holds this point
  } else if (state.sampler()) {
    // As on the ranks that restored it: the loop's setEpoch(epoch) keeps this position (a failure
    // inside an agreement left it as the step moved it, not restored).
    state.sampler()->loadState(state.sampler()->state());
  }
  state.joinGroups(ranks->group(), entries);
  copiedAt = -1;
  say("in-place recovery: healed " + healed + "; continuing from " +
      describeProgress(epoch, stepInEpoch, globalStep) + " with rank " + std::to_string(exchange ? exchange->donor : 0) +
      "'s state (group generation " + std::to_string(groupGeneration()) + ")");
  agreed();
  return pointFromMemory(held == -1 ? "joined the running group in place of a failed rank, its shard from a copy, at "
                                    : "recovered in place (shards healed from copies) at ");
}

ResumePoint ResilientTraining::Impl::reloadFromFiles(const std::string& why, bool replacement) {
  say("in-place recovery: a lost shard cannot come back from memory (" + why + "): every rank reloads the snapshot files");
  // The run's id first: a replacement takes the survivors' (which names this run's own saves).
  const double id = ranks->allReduce({runIdValue()}, c10d::ReduceOp::MAX, "in-place recovery (the run's id)")[0];
  if (replacement || runId.empty()) runId = runIdText(id);
  ResumePoint point;
  std::vector<SkippedSnapshot> unusable;
  resumeShards.clear();
  // The slot's newest (not ResilienceOptions::resumeFrom's file, which started this run).
  std::optional<Snapshot> snap = chooseResumeSource(point, unusable, /*slotOnly=*/true);
  // Without resuming, a file the slot held before this run (another run's) is none of this run's.
  if (snap && !o.resume() && snap->header.saveId.rfind(runId + "-", 0) != 0) snap.reset();
  const double g = snap ? static_cast<double>(snap->globalStep) : -1.0;
  const auto agreedValues = ranks->allReduce({g, -g}, c10d::ReduceOp::MAX, "in-place recovery (reloading the snapshot files)");
  if (agreedValues[0] != -agreedValues[1])
    throw DistributedError("in-place recovery: the ranks found different snapshots to reload (global steps " +
                           std::to_string(-agreedValues[1]) + " to " + std::to_string(agreedValues[0]) +
                           "): every rank must see the same snapshot files");
  if (!snap)
    throw DistributedError("in-place recovery: " + why + ", and no snapshot of this run holds an earlier step to reload");
  state.joinGroups(ranks->group(), &snap->userState);
  restore(*snap);
  resumeShards.clear();
  heldCopyStep = -1;
  copiedAt = -1;
  say("in-place recovery: " + point.message);
  agreed();
  point.resumed = true;
  point.file = snap->source;
  point.epoch = epoch;
  point.stepInEpoch = stepInEpoch;
  point.globalStep = globalStep;
  return point;
}

bool ResilientTraining::Impl::joinWithState(std::int64_t heldStep, const ItemDict* entries) {
  const auto exchange = recovery->exchangeState(*ranks, heldStep, stepInEpoch == 0 && epoch > 0, [&] {
    Snapshot mine = state.capture(identity(), progress(), currentKind() == Kind::kEpochComplete, entries, nullptr);
    mine.header.saveId = saveId();
    return encodeSnapshot(mine);
  });
  if (!exchange) {
    state.joinGroups(ranks->group(), nullptr);
    return false;
  }
  if (exchange->received) {
    // A replacement takes the run's id from the state it receives (its own draw was never agreed).
    const std::string& id = exchange->received->header.saveId;
    if (runId.empty() && id.find('-') != std::string::npos) runId = id.substr(0, id.find('-'));
    entries = &exchange->received->userState;
    restore(*exchange->received, /*rng=*/false);
    saver->forgetSaved();  // nothing on disk holds this point
  } else if (state.sampler()) {
    // As on the ranks that restored it: the loop's setEpoch(epoch) keeps this position.
    state.sampler()->loadState(state.sampler()->state());
  }
  state.joinGroups(ranks->group(), entries);
  say("in-place recovery: continuing from " + describeProgress(epoch, stepInEpoch, globalStep) + " with rank " +
      std::to_string(exchange->donor) + "'s state (group generation " + std::to_string(groupGeneration()) + ")");
  agreed();
  return true;
}

ResumePoint ResilientTraining::Impl::pointFromMemory(const std::string& what) const {
  ResumePoint point;
  point.resumed = true;
  point.exact = true;
  point.epoch = epoch;
  point.stepInEpoch = stepInEpoch;
  point.globalStep = globalStep;
  point.message = what + describeProgress(epoch, stepInEpoch, globalStep);
  return point;
}

} // namespace ctorch
