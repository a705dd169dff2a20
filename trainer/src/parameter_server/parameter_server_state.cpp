// ParameterServer as a checkpoint sees it (ctorch/stateful.hpp): a ShardedOptimizerState, the
// servers' shares of the optimizer state written as a ZeroRedundancyOptimizer's are (every rank its
// own file; a worker's holds nothing). Its servers and workers play fixed roles: it cannot follow a
// group re-formed in place.
#include "ctorch/parameter_server.hpp"

namespace ctorch {

std::string ParameterServer::whyNotInPlace() const {
  return "its parameter server's servers and workers play fixed roles, which a re-formed group does not keep";
}

} // namespace ctorch
