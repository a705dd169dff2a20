# The Python side of bench/gpu/step_bench.sh: PyTorch's DistributedDataParallel on the model of
# bench/gpu/step_bench.cpp (models/python/ctorch_models.py), the same batch, data already on the
# device, precision, optimizer (SGD, momentum 0.9, weight decay 5e-4; PyTorch's default kernels,
# which are the multi-tensor "foreach" ones on CUDA) and loss, in up to three variants, measured in
# rounds that alternate between them inside this process:
#   eager           the model as it is (contiguous)
#   channels-last   parameters and input in channels-last memory format
#   compile         torch.compile(ddp) in its default mode, inductor (a failure to compile is recorded,
#                   not fatal)
# Usage: step_bench.py [--model resnet18] [--batch 256] [--steps 200] [--warmup 15] [--precision bf16]
#                      [--rounds 3] [--first-round 1] [--variants eager,channels-last,compile]
#        step_bench.py --flops [--model resnet18]       the model's forward FLOPs per sample, counted
#        step_bench.py --report FILE [--peak-tflops 989] the summary of the lines step_bench.sh gathered
# Prints one line per variant and round: impl=py-<variant> ... round=r samples_per_s=... step_ms=...
# (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment; bench/gpu/step_bench.sh runs one
# process, WORLD_SIZE=1 without MASTER_PORT: the process group then uses an in-process HashStore.)
import argparse
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "models", "python"))

IMAGE = (3, 32, 32)  # CIFAR-shaped input, as ctorch-train's resnet18 runs


def forward_flops(model_name):
    """Multiply-adds of every convolution and linear layer for one sample, times 2 (what FLOP counts
    of CNNs usually mean; BatchNorm, ReLU, pooling and the additions of the residuals are left out:
    under 1 % of ResNet-18's)."""
    import torch
    import ctorch_models
    net = ctorch_models.create_model(model_name, in_channels=IMAGE[0], image_size=IMAGE[1])
    macs = [0]

    def conv(m, inp, out):
        k = m.kernel_size[0] * m.kernel_size[1] * (m.in_channels // m.groups)
        macs[0] += out.numel() * k

    def linear(m, inp, out):
        macs[0] += out.numel() * m.in_features

    for m in net.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.register_forward_hook(conv)
        elif isinstance(m, torch.nn.Linear):
            m.register_forward_hook(linear)
    with torch.no_grad():
        net.eval()(torch.zeros(1, *IMAGE))
    return 2 * macs[0]


def report(path, peak_tflops, flops_fwd):
    """Medians, spreads, ratios and achieved TFLOP/s of the impl= lines in `path`."""
    rows = {}
    status = {}
    for line in open(path, errors="replace"):
        m = re.match(r"^impl=(\S+) .*batch=(\d+) .*samples_per_s=([0-9.]+)", line)
        if m:
            rows.setdefault((int(m.group(2)), m.group(1)), []).append(float(m.group(3)))
            continue
        m = re.match(r"^impl=(\S+) .*batch=(\d+) .*status=(\S+)(?: reason=(.*))?", line)
        if m:
            status[(int(m.group(2)), m.group(1))] = (m.group(3) + (": " + m.group(4) if m.group(4) else ""))[:160]
    train = 3 * flops_fwd
    print(f"step_bench: input {IMAGE[0]}x{IMAGE[1]}x{IMAGE[2]}, forward {flops_fwd / 1e9:.3f} GFLOP/sample "
          f"(2 x multiply-adds of convs and linears), training step ~3x = {train / 1e9:.3f} GFLOP/sample; "
          f"peak {peak_tflops:g} TFLOP/s (dense bf16, H100/H200 SXM)")
    pairs = [("cpp-eager", "py-eager"), ("cpp-mt-cl", "py-channels-last"), ("cpp-graphs", "py-compile"),
             ("cpp-graphs-mt-cl", "py-compile"), ("cpp-mt-cl", "py-eager"), ("cpp-graphs", "py-eager"),
             ("cpp-graphs-mt-cl", "py-eager")]
    batches = sorted({b for b, _ in list(rows) + list(status)}, reverse=True)
    for batch in batches:
        impls = sorted({i for b, i in list(rows) + list(status) if b == batch})
        medians = {}
        for impl in impls:
            v = rows.get((batch, impl), [])
            if not v:
                print(f"step_bench: batch {batch} {impl}: {status.get((batch, impl), 'no samples')}")
                continue
            med = statistics.median(v)
            medians[impl] = med
            tflops = med * train / 1e12
            print(f"step_bench: batch {batch} {impl}: median {med:.1f} samples/s (min {min(v):.1f}, max {max(v):.1f}, "
                  f"{len(v)} rounds; step {1000 * batch / med:.2f} ms); {tflops:.2f} TFLOP/s = "
                  f"{100 * tflops / peak_tflops:.2f} % of peak")
        for cpp, py in pairs:
            if cpp in medians and py in medians:
                print(f"step_bench: batch {batch} ratio {cpp} / {py} = {medians[cpp] / medians[py]:.3f} "
                      f"(medians; >1: ctorch faster)")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--first-round", type=int, default=1)
    p.add_argument("--variants", default="eager,channels-last,compile")
    # The CPU rehearsal (scripts/gpu/selftest.sh) traces with "eager": inductor's C++ codegen takes
    # minutes on 2 cores. On a GPU the default, inductor.
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--flops", action="store_true")
    p.add_argument("--report")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    a = p.parse_args()
    if a.flops:
        print(f"flops_per_sample_forward={forward_flops(a.model)}")
        return
    if a.report:
        report(a.report, a.peak_tflops, forward_flops(a.model))
        return

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    import ctorch_models

    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and "MASTER_PORT" not in os.environ:
        # One process (step_bench.sh): no TCPStore, so no port to choose.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()) if cuda \
        else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.backends.cudnn.benchmark = True
    autocast = a.precision != "fp32"
    dtype = torch.float16 if a.precision == "fp16" else torch.bfloat16
    torch.manual_seed(1)
    x_plain = torch.randn(a.batch, *IMAGE).to(device)
    y = torch.randint(0, 10, (a.batch,)).to(device)

    def synchronize():
        if cuda:
            torch.cuda.synchronize(device)

    def make(variant):
        torch.manual_seed(0)
        net = ctorch_models.create_model(a.model, in_channels=IMAGE[0], image_size=IMAGE[1]).to(device)
        x = x_plain
        if variant == "channels-last":
            net = net.to(memory_format=torch.channels_last)
            x = x_plain.contiguous(memory_format=torch.channels_last)
        ddp = DistributedDataParallel(net, device_ids=[device.index] if cuda else None, bucket_cap_mb=25)
        model = torch.compile(ddp, backend=a.compile_backend) if variant == "compile" else ddp
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
        scaler = torch.amp.GradScaler(device.type, enabled=a.precision == "fp16")

        def step():
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=dtype, enabled=autocast):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            return loss
        return step

    common = f"model={a.model} device={device} precision={a.precision} batch={a.batch}"
    steps = {}
    for variant in [v for v in a.variants.split(",") if v]:
        started = time.perf_counter()
        try:
            step = make(variant)
            for _ in range(a.warmup):
                step()
            synchronize()
            steps[variant] = step
            print(f"impl=py-{variant} {common} status=ready warmup_s={time.perf_counter() - started:.1f}", flush=True)
        except Exception as e:  # torch.compile may not work here: recorded, the others go on
            reason = " ".join(str(e).split())[:300] or type(e).__name__
            print(f"impl=py-{variant} {common} status=failed reason={type(e).__name__}: {reason}", flush=True)
    for r in range(a.first_round, a.first_round + a.rounds):
        for variant, step in steps.items():
            synchronize()
            start = time.perf_counter()
            last = None
            for _ in range(a.steps):
                last = step()
            last_loss = last.item()
            synchronize()
            seconds = time.perf_counter() - start
            print(f"impl=py-{variant} {common} round={r} steps={a.steps} samples_per_s={a.batch * a.steps / seconds:.1f} "
                  f"step_ms={1000.0 * seconds / a.steps:.3f} loss={last_loss:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
