// Stop requests: SIGTERM and SIGUSR1 (Slurm's preemption warnings; ctorchrun forwards them) and
// SIGINT only set a flag here; the training loop reads it after every step, all ranks agree on it
// through an allreduce, write a snapshot and exit with contract::kExitPreempted. Copies of the same
// stop (within contract::kDuplicateStopWindowMs of the first: `timeout`, a process-group kill and
// Slurm's scancel deliver one stop two or three times) are one request; a SIGTERM or SIGINT that
// comes later, while stopping, ends the process at once (the default action).
#pragma once

namespace ctorch {

// Installs the handlers (SA_RESTART, so system calls in other threads are not interrupted).
void installStopHandlers();
// The signal that asked to stop, or 0.
int stopSignal();
// For tests and embedding: behave as if `signo` had arrived (0 clears the request).
void setStopSignal(int signo);

}  // namespace ctorch
