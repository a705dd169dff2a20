// A failed step of the Trainer (trainer_impl.hpp): recovered in place where the run can (the
// launcher's replacement joins, ctorch::ResilientTraining restores the agreed point), else the
// failure in one line that says where, with the hang guard's bound for a lost or silent peer.
#include "trainer_impl.hpp"

#include <ctorch/errors.hpp>

namespace ctorch::train::trainer_parts {

namespace {

// A step that failed in LibTorch or Gloo (a peer died, stopped or went away; a collective timed
// out) becomes one line saying where, with the hang guard's bound. The library's own errors
// (DistributedError from DDP, the agreement or the shared-memory allreduce) keep their type; a line
// that already names the rank (the agreement's) is not prefixed again.
[[noreturn]] void stepFailed(const std::exception& e, int rank, std::int64_t globalStep, std::chrono::seconds timeout) {
  std::string text = errorMessage(e);
  if (const auto cut = text.find('\n'); cut != std::string::npos) text.resize(cut);
  if (text.rfind("rank ", 0) != 0)
    text = "rank " + std::to_string(rank) + ": step " + std::to_string(globalStep + 1) + " failed: " + text;
  // The hang guard's bound belongs to lost or silent peers only, not to a disk or a shape error.
  const auto* ours = dynamic_cast<const DistributedError*>(&e);
  if (!isLostPeer(e)) throw Error(text);
  const std::string message =
      text + " (collectives give up on a silent peer after --timeout " + std::to_string(timeout.count()) + " s)";
  if (ours ? dynamic_cast<const DistributedTimeout*>(&e) != nullptr
           : text.find("imed out") != std::string::npos || text.find("imeout") != std::string::npos)
    throw DistributedTimeout(message);
  throw DistributedError(message);
}

}  // namespace

// Called from the handler of a failed step: recovers in place where the run can, else the step's
// failure in one line (stepFailed).
void Trainer::recoverFromFailedStep(const std::exception& e) {
  if (!training_->canRecoverInPlace()) stepFailed(e, rank_, training_->globalStep(), o_.timeout);
  recoverInPlace();
}

// Called from a handler of a failed collective: re-forms the group with the launcher's replacement
// and restores the agreed point (ResilientTraining::recover), or fails the step as without it.
void Trainer::recoverInPlace() {
  try {
    const ResumePoint p = training_->recover();
    // The rank that sent the state kept its own tally: every rank drops the losses not summed yet
    // (the others never had them), so the tally stays the same on every rank.
    tally_.dropUnsummed();
    intervalLocalLoss_ = 0.0;
    console_.line("in-place recovery: " + p.message + " (group generation " + std::to_string(groupGeneration()) + ")");
  } catch (const DistributedError& e) {
    stepFailed(e, rank_, training_->globalStep(), o_.timeout);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    stepFailed(e, rank_, training_->globalStep(), o_.timeout);
  }
}

}  // namespace ctorch::train::trainer_parts
