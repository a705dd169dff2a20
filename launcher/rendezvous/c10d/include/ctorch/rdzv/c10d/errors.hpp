// The errors of the c10d dynamic rendezvous: a small tree under RendezvousError so that the
// agent can tell "try again / give up / bad input" apart. Messages are one line, quote the bad
// value or the state that led to the failure, and say what to do.
#pragma once

#include <stdexcept>
#include <string>

namespace ctorch::rdzv::c10d {

struct RendezvousError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The round did not complete within join_timeout (too few nodes), or a heartbeat / close
// operation missed its deadline.
struct RendezvousTimeout : RendezvousError {
  using RendezvousError::RendezvousError;
};

// The rendezvous was closed (the job finished or was shut down): nobody may join any more.
struct RendezvousClosed : RendezvousError {
  using RendezvousError::RendezvousError;
};

// A node that was only a spare (redundancy list) leaves because the job finished without it.
struct RendezvousGracefulExit : RendezvousError {
  using RendezvousError::RendezvousError;
};

// The shared state cannot be used: not JSON, a newer format version, another run id.
struct RendezvousStateError : RendezvousError {
  using RendezvousError::RendezvousError;
};

// A bad --rdzv-conf entry, endpoint or setting (names the key and the value).
struct RendezvousConfigError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

} // namespace ctorch::rdzv::c10d
