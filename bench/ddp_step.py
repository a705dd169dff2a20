# Per-step time of PyTorch's DistributedDataParallel (/usr/bin/python3) on the same models, data
# sizes, optimizer and phases as bench/ddp_step.cpp: data (a batch gathered from a preloaded set of
# 8), zero_grad, forward with the loss, backward (with DDP's overlapped reduction), optimizer; minor
# page faults per step; the same steps under no_sync() (backward without the reduction); peak RSS.
# Run by bench/ddp_step.sh.
# Usage: ddp_step.py [steps] [warmup] [batch] [hidden] [mlp|cnn|linear|resnet18]   (RANK, WORLD_SIZE, ...)
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models", "python"))
from ctorch_models import ResNet18  # noqa: E402


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


def median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else 0.0


def main() -> None:
    args = sys.argv[1:] + ["50", "10", "64", "1024", "mlp"][len(sys.argv) - 1:]
    steps, warmup, batch, hidden = (int(a) for a in args[:4])
    kind = args[4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    if kind == "cnn":
        model = Cnn()
    elif kind == "resnet18":
        model = ResNet18(3, 10)
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
    pool = 8 * batch
    if kind == "cnn":
        xs, ys = torch.randn(pool, 1, 28, 28), torch.randint(0, 10, (pool,))
    elif kind == "resnet18":
        xs, ys = torch.randn(pool, 3, 32, 32), torch.randint(0, 10, (pool,))
    elif kind == "linear":
        xs, ys = torch.randn(pool, 20), torch.randn(pool, 1)
    else:
        xs, ys = torch.randn(pool, hidden), torch.randint(0, 10, (pool,))
    loss_of = torch.nn.functional.mse_loss if kind == "linear" else torch.nn.functional.cross_entropy
    phases = {k: [] for k in ("total", "data", "zero", "forward", "backward", "optimizer", "faults", "nosync")}

    def step(record):  # "warmup": not recorded; "synced": every phase; "nosync": only the backward
        t0 = time.perf_counter()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        index = torch.randint(0, pool, (batch,))
        x, y = xs.index_select(0, index), ys.index_select(0, index)
        t1 = time.perf_counter()
        optimizer.zero_grad()
        t2 = time.perf_counter()
        loss = loss_of(ddp(x), y)
        t3 = time.perf_counter()
        loss.backward()
        t4 = time.perf_counter()
        optimizer.step()
        t5 = time.perf_counter()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        if record == "nosync":
            phases["nosync"].append((t4 - t3) * 1000.0)
        if record != "synced":
            return
        for key, ms in (("total", t5 - t1), ("data", t1 - t0), ("zero", t2 - t1), ("forward", t3 - t2),
                        ("backward", t4 - t3), ("optimizer", t5 - t4)):
            phases[key].append(ms * 1000.0)
        phases["faults"].append(faults)

    for i in range(warmup + steps):
        step("warmup" if i < warmup else "synced")
    with ddp.no_sync():  # the same steps without the reduction: backward is the compute alone
        for _ in range(steps):
            step("nosync")
    dist.barrier()
    if rank == 0:
        m = {k: median(v) for k, v in phases.items()}
        mean = sum(phases["total"]) / len(phases["total"])
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        print(f"impl=python model={kind} world={dist.get_world_size()} params={params} batch={batch} steps={steps} "
              f"median_ms={m['total']:.4f} mean_ms={mean:.4f} data_ms={m['data']:.4f} zero_ms={m['zero']:.4f} "
              f"forward_ms={m['forward']:.4f} backward_ms={m['backward']:.4f} backward_nosync_ms={m['nosync']:.4f} "
              f"optimizer_ms={m['optimizer']:.4f} faults_per_step={m['faults']:.0f} maxrss_mib={maxrss:.1f} "
              f"threads={torch.get_num_threads()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
