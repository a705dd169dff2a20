# The Python twin of bench/gpu/step_bench.cpp: PyTorch's DistributedDataParallel on the same model
# (models/python/ctorch_models.py), batch, data already on the device, precision, optimizer and loss.
# Usage: step_bench.py [--model resnet18] [--batch 256] [--steps 50] [--warmup 10] [--precision bf16|fp16|fp32]
# (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment; bench/gpu/step_bench.sh sets them.)
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "models", "python"))
import ctorch_models  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()) if cuda \
        else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    net = ctorch_models.create_model(a.model, in_channels=3, image_size=32).to(device)
    ddp = DistributedDataParallel(net, device_ids=[device.index] if cuda else None, bucket_cap_mb=25)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    autocast = a.precision != "fp32"
    dtype = torch.float16 if a.precision == "fp16" else torch.bfloat16
    scaler = torch.cuda.amp.GradScaler(enabled=a.precision == "fp16")
    torch.manual_seed(1)
    x = torch.randn(a.batch, 3, 32, 32).to(device)
    y = torch.randint(0, 10, (a.batch,)).to(device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss

    for _ in range(a.warmup):
        step()
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    last = None
    for _ in range(a.steps):
        last = step()
    last_loss = last.item()
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    print(f"impl=python model={a.model} device={device} precision={a.precision} batch={a.batch} steps={a.steps} "
          f"samples_per_s={a.batch * a.steps / seconds:.1f} step_ms={1000.0 * seconds / a.steps:.3f} "
          f"loss={last_loss:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
