# Per-step time of PyTorch's DistributedDataParallel (torch 1.13, /usr/bin/python3) on the same MLP,
# data sizes and optimizer as bench/ddp_step.cpp. Run by bench/ddp_step.sh.
# Usage: ddp_step.py [steps] [warmup] [batch] [hidden]   (RANK, WORLD_SIZE, ... in the environment)
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    steps, warmup, batch, hidden = (int(a) for a in (sys.argv[1:] + ["50", "10", "64", "1024"][len(sys.argv) - 1:]))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, hidden // 8), torch.nn.ReLU(),
                                torch.nn.Linear(hidden // 8, 10))
    params = sum(p.numel() for p in model.parameters())
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(1 + rank)
    x = torch.randn(batch, hidden)
    y = torch.randint(0, 10, (batch,))
    ms = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        elapsed = (time.perf_counter() - start) * 1000.0
        if i >= warmup:
            ms.append(elapsed)
    dist.barrier()
    if rank == 0:
        ms.sort()
        print(f"impl=python world={dist.get_world_size()} params={params} batch={batch} steps={steps} "
              f"median_ms={ms[len(ms) // 2]:.3f} mean_ms={sum(ms) / len(ms):.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
