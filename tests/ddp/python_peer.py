# A Python (PyTorch 1.13, /usr/bin/python3) worker that joins a job with C++ workers running
# tests/ddp/process_group_test.cpp's mixed_peer: same environment rules (env://, agent store), same
# MLP, data, optimizer and steps. Prints the allreduce result and its parameters' bytes as hex.
# Usage: python_peer.py STEPS   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment)
import datetime
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print(f"allreduce {t.item():g}", flush=True)
    torch.manual_seed(1234 + rank)  # different on every rank: DDP must broadcast rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        torch.manual_seed(100 + step * world + rank)
        x = torch.randn(4, 8)
        y = torch.randn(4, 4)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
    data = b"".join(p.detach().contiguous().numpy().tobytes() for p in model.parameters())
    print("params " + data.hex(), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
