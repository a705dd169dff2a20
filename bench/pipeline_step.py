#!/usr/bin/env python3
"""Python's peer of pipeline_bench (bench/pipeline_vs_python.sh): the same MLP, partition, data and
schedule with torch.distributed.pipelining under torchrun; prints one line per rank with the median
step (zero_grad, schedule.step, optimizer.step) over the measured steps.
Usage: torchrun --nproc-per-node S pipeline_step.py gpipe|1f1b layers width batch microBatches steps"""
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe


def balanced(counts, stages):
    # ctorch::balancedPartitionOfCounts: the smallest largest stage, the earliest cut on ties.
    n, inf = len(counts), float("inf")
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == inf:
                    continue
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    sizes, end = [0] * stages, n
    for k in range(stages, 0, -1):
        sizes[k - 1] = end - cut[k][end]
        end = cut[k][end]
    return sizes


def main():
    kind, layers, width, batch, micro, steps = sys.argv[1], *map(int, sys.argv[2:7])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    children = []
    for _ in range(layers):
        children += [nn.Linear(width, width), nn.ReLU()]
    children.append(nn.Linear(width, 10))
    sizes = balanced([sum(p.numel() for p in c.parameters()) for c in children], world)
    first = sum(sizes[:rank])
    part = nn.Sequential(*children[first:first + sizes[rank]])
    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
    schedule = cls(stage, micro, loss_fn=lambda out, y: F.cross_entropy(out, y))
    optimizer = torch.optim.SGD(part.parameters(), lr=0.01)
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))

    def one_step():
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        optimizer.step()

    for _ in range(2):
        one_step()
    dist.barrier()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        one_step()
        times.append((time.perf_counter() - start) * 1e3)
    print(f"rank={rank} impl=python schedule={kind} S={world} M={micro} step_ms={statistics.median(times):.1f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
