# The Python peer check: a small gloo DDP job that prints its worker environment and its final
# parameters; run under Debian's torchrun and under ctorchrun, the outputs must agree.
import os

import torch
import torch.distributed as dist

CONTRACT = ["RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
            "WORLD_SIZE", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS",
            "NCCL_ASYNC_ERROR_HANDLING"]
for k in CONTRACT:
    print(f"ENV {k}={os.environ.get(k, '<unset>')}", flush=True)

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
g = torch.Generator().manual_seed(1000 + rank)
for _ in range(5):
    x = torch.randn(16, 6, generator=g)
    loss = ddp(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
print("PARAMS " + " ".join(f"{v:.6f}" for v in flat.tolist()), flush=True)
dist.destroy_process_group()
