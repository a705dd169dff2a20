# init_process_group("gloo") + all_reduce; with TORCHELASTIC_USE_AGENT_STORE=True every rank is a
# client of the store at MASTER_ADDR:MASTER_PORT (ours).
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
assert t.item() == world * (world + 1) / 2, t.item()
dist.barrier()
print(f"ALLREDUCE-OK rank={rank} world={world} sum={t.item()}", flush=True)
dist.destroy_process_group()
