#!/usr/bin/python3
# Golden index lists of Python's torch.utils.data.DistributedSampler, for tests/sampler.
# Made with Debian's python3-torch 1.13 (not the python3 on PATH, which has no torch):
#   /usr/bin/python3 tests/sampler/make_golden.py > tests/sampler/golden/distributed_sampler.json
# One case per line: {size, world, seed, epoch, shuffle, drop_last, num_samples, total_size,
# ranks} where ranks[r] is rank r's list. The lists come from the real sampler (set_epoch + iter).
import itertools
import json
import sys

import torch
from torch.utils.data.distributed import DistributedSampler


def cases():
    sizes = [0, 1, 2, 5, 7, 10, 16, 17, 31, 100]
    worlds = [1, 2, 3, 4, 8]
    for size, world, shuffle, drop_last in itertools.product(sizes, worlds, [True, False], [False, True]):
        # Without shuffle the seed and epoch must not matter: still vary them a little to prove it.
        grid = itertools.product([0, 42], [0, 1, 7]) if shuffle else [(0, 0), (42, 1)]
        for seed, epoch in grid:
            yield size, world, seed, epoch, shuffle, drop_last
    # Larger lists: the permutation itself over many elements, padding and dropping at scale.
    for world, drop_last in [(3, False), (8, True)]:
        yield 5003, world, 2024, 3, True, drop_last


def main():
    out = sys.stdout
    out.write('{"generator": "tests/sampler/make_golden.py", "torch": %s, "cases": [\n'
              % json.dumps(torch.__version__))
    first = True
    for size, world, seed, epoch, shuffle, drop_last in cases():
        ranks = []
        for rank in range(world):
            s = DistributedSampler(range(size), num_replicas=world, rank=rank, shuffle=shuffle,
                                   seed=seed, drop_last=drop_last)
            s.set_epoch(epoch)
            ranks.append(list(iter(s)))
        case = {"size": size, "world": world, "seed": seed, "epoch": epoch, "shuffle": shuffle,
                "drop_last": drop_last, "num_samples": len(s), "total_size": s.total_size,
                "ranks": ranks}
        out.write(("" if first else ",\n") + json.dumps(case, separators=(",", ":")))
        first = False
    out.write("\n]}\n")


if __name__ == "__main__":
    main()
