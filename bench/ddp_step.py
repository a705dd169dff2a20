# Per-step time of PyTorch's DistributedDataParallel (torch 1.13, /usr/bin/python3) on the same
# models, data sizes and optimizer as bench/ddp_step.cpp. Run by bench/ddp_step.sh.
# Usage: ddp_step.py [steps] [warmup] [batch] [hidden] [mlp|cnn|linear]   (RANK, WORLD_SIZE, ...)
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


class Cnn(torch.nn.Module):
    """The seeds' CNN, as bench/ddp_step.cpp builds it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 32, 3)
        self.conv2 = torch.nn.Conv2d(32, 64, 3)
        self.fc1 = torch.nn.Linear(9216, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        x = torch.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


def main() -> None:
    args = sys.argv[1:] + ["50", "10", "64", "1024", "mlp"][len(sys.argv) - 1:]
    steps, warmup, batch, hidden = (int(a) for a in args[:4])
    kind = args[4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    if kind == "cnn":
        model = Cnn()
    elif kind == "linear":
        model = torch.nn.Sequential(torch.nn.Linear(20, 1))
    else:
        model = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                    torch.nn.Linear(hidden, hidden // 8), torch.nn.ReLU(),
                                    torch.nn.Linear(hidden // 8, 10))
    params = sum(p.numel() for p in model.parameters())
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(1 + rank)
    if kind == "cnn":
        x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    elif kind == "linear":
        x, y = torch.randn(batch, 20), torch.randn(batch, 1)
    else:
        x, y = torch.randn(batch, hidden), torch.randint(0, 10, (batch,))
    loss_of = torch.nn.functional.mse_loss if kind == "linear" else torch.nn.functional.cross_entropy
    ms = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_of(ddp(x), y)
        loss.backward()
        optimizer.step()
        elapsed = (time.perf_counter() - start) * 1000.0
        if i >= warmup:
            ms.append(elapsed)
    dist.barrier()
    if rank == 0:
        ms.sort()
        print(f"impl=python model={kind} world={dist.get_world_size()} params={params} batch={batch} steps={steps} "
              f"median_ms={ms[len(ms) // 2]:.4f} mean_ms={sum(ms) / len(ms):.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
