# Python's side of the FSDP comparison (issue 31): the model, data and optimizer of bench/zero_memory.cpp
# under PyTorch's DDP or FSDP2 (fully_shard), printing zero_memory_bench's line. Run by bench/fsdp_vs_python.sh.
# Usage (as each torchrun worker, PyTorch 2.x): fsdp_step.py <ddp|zero|fsdp|fsdp-noreshard> <layers> <width> <steps>
#   ddp             DistributedDataParallel(gradient_as_bucket_view=True), the whole Adam on every rank
#   zero            the same DDP with ZeroRedundancyOptimizer over Adam (ZeRO-1, zero_memory_bench's zero)
#   fsdp            fully_shard on each Linear (reshard_after_forward=True), then on the root (its default)
#   fsdp-noreshard  the same with reshard_after_forward=False (gathered parameters kept until backward:
#                   ZeRO-2-like, FSDP1's SHARD_GRAD_OP)
# Each rank prints: rank=.. world=.. mode=.. params_mb=.. grads_mb=.. optimizer_mb=.. peak_rss_mb=.. step_ms=..
# with this rank's LOCAL bytes (for FSDP the shards', DTensor.to_local()) and the median step after the first.
import re
import resource
import sys
import time

import os
import torch
import torch.distributed as dist

MODES = ("ddp", "zero", "fsdp", "fsdp-noreshard")


def fail(message: str) -> None:
    print(f"fsdp_step.py: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def bytes_of(tensors) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors if t is not None)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Every tensor of this rank's optimizer state (Adam: exp_avg, exp_avg_sq and the 4-byte step)."""
    optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: its local optimizer
    return sum(bytes_of(v for v in s.values() if isinstance(v, torch.Tensor)) for s in optimizer.state.values())


def parse(argv):
    if len(argv) != 5:
        fail("usage: fsdp_step.py <ddp|zero|fsdp|fsdp-noreshard> <layers> <width> <steps>")
    mode = argv[1]
    if mode not in MODES:
        fail(f"unknown mode '{mode}' (one of {', '.join(MODES)})")
    numbers = []
    for name, value in zip(("layers", "width", "steps"), argv[2:]):
        try:
            number = int(value)
        except ValueError:
            number = 0
        if number < 1:
            fail(f"{name} must be a positive integer, not '{value}'")
        numbers.append(number)
    version = tuple(int(v) for v in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    if mode.startswith("fsdp") and version < (2, 4):
        fail(f"mode '{mode}' needs fully_shard (PyTorch 2.4 or later); this is PyTorch {torch.__version__}")
    return (mode, *numbers)


def wrap(model: torch.nn.Sequential, mode: str, world: int) -> torch.nn.Module:
    if mode in ("ddp", "zero"):
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model, gradient_as_bucket_view=True)
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # PyTorch 2.4 and 2.5 had it only here
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    # A CPU mesh over the default (Gloo) group; left out, fully_shard picks CUDA's where torch has it.
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh, reshard_after_forward=(mode == "fsdp"))
    if mode == "fsdp":
        return fully_shard(model, mesh=mesh)
    return fully_shard(model, mesh=mesh, reshard_after_forward=False)


def main() -> None:
    mode, layers, width, steps = parse(sys.argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    wrapped = wrap(model, mode, world)
    # FSDP replaced the parameters by their sharded DTensors: build the optimizer over them (after wrapping).
    # PY_OPTIMIZER=default|foreach|fused: Adam's implementation (default: PyTorch's own choice, which
    # on the CPU is one parameter at a time).
    kind = os.environ.get("PY_OPTIMIZER", "default")
    adam_kwargs = {"lr": 1e-4, **({"foreach": True} if kind == "foreach" else {"fused": True} if kind == "fused" else {})}
    if mode == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        optimizer = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.Adam, **adam_kwargs)
    else:
        optimizer = torch.optim.Adam(wrapped.parameters(), **adam_kwargs)
    ms = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        x = torch.randn(8, width)
        wrapped(x).pow(2).mean().backward()
        optimizer.step()
        ms.append((time.perf_counter() - start) * 1000.0)
    params = list(wrapped.parameters())
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    rest = sorted(ms[1:])  # the first step builds the optimizer state: left out, as zero_memory_bench does
    step_ms = rest[len(rest) // 2] if rest else ms[0]  # zero_memory_bench's ms[1 + (n - 1) / 2]
    print(f"rank={rank} world={world} mode={mode} params_mb={bytes_of(params) / 1e6:.1f} "
          f"grads_mb={bytes_of(p.grad for p in params) / 1e6:.1f} optimizer_mb={state_bytes(optimizer) / 1e6:.1f} "
          f"peak_rss_mb={peak_rss_mb:.1f} step_ms={step_ms:.0f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
