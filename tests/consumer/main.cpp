// Uses the installed library the way a user's trainer would: the process group from the
// environment (torchrun variables, or none for a world of 1) and one DistributedDataParallel step.
#include <ctorch/compat.hpp>  // needs the installed shim on LibTorch packages without context.h
#include <ctorch/ddp.hpp>
#include <ctorch/distributed.hpp>
#include <ctorch/version.hpp>

#include <torch/torch.h>

#include <iostream>

int main() {
  std::cout << ctorch::versionString() << std::endl;
  try {
    ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    const int rank = ctorch::getRank(), world = ctorch::getWorldSize();

    torch::manual_seed(rank);  // different weights everywhere: DDP starts all ranks from rank 0's
    torch::nn::Linear model(4, 2);
    ctorch::DistributedDataParallel ddp(model, ctorch::DDPOptions().gradientAsBucketView(true));
    torch::optim::SGD optimizer(ddp.parameters(), 0.1);
    ctorch::compat::zeroGrad(optimizer, /*setToNone=*/false);

    // Rank r feeds rows of (r + 1): d(sum of outputs)/d(weight) = 2 (r + 1) on rank r, so the
    // average over the ranks is world + 1 in every entry.
    auto loss = ddp(torch::full({2, 4}, static_cast<float>(rank + 1))).sum();
    loss.backward();
    const bool averaged = torch::allclose(model->weight.grad(), torch::full({2, 4}, static_cast<float>(world + 1)));
    optimizer.step();
    std::cout << "consumer: rank " << rank << "/" << world << " ("
              << toString(ctorch::getDistributedEnv().launcher) << ") ddp step "
              << (averaged ? "averaged" : "NOT averaged") << std::endl;
    ctorch::barrier();
    ctorch::destroyProcessGroup();
    return averaged ? 0 : 1;
  } catch (const ctorch::ConfigError& e) {
    std::cerr << "consumer: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "consumer: " << e.what() << std::endl;
    return 1;
  }
}
