"""Python's side of bench/optim/optim_step.sh: one torch.optim step (default, foreach=True,
fused=True) over the same parameters as optim_step_bench. Usage: optim_step.py <resnet18|mlp> <steps> [threads]"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "models", "python"))


def parameters(which):
    torch.manual_seed(0)
    if which == "resnet18":
        from ctorch_models import ResNet18
        return [p.detach().clone().requires_grad_() for p in ResNet18(3, 10).parameters()]
    out = []
    for _ in range(3):
        out += [torch.randn(4096, 4096, requires_grad=True), torch.randn(4096, requires_grad=True)]
    return out


def main():
    which, steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    makers = {
        "sgd": lambda ps, kw: torch.optim.SGD(ps, lr=0.01, momentum=0.9, weight_decay=5e-4, **kw),
        "adam": lambda ps, kw: torch.optim.Adam(ps, lr=1e-4, **kw),
        "adamw": lambda ps, kw: torch.optim.AdamW(ps, lr=1e-3, **kw),
    }
    for name, make in makers.items():
        for kernels, kw in (("default", {}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
            ps = parameters(which)
            for p in ps:
                p.grad = torch.randn_like(p)
            try:
                opt = make(ps, kw)
                opt.step()
            except (RuntimeError, TypeError, ValueError) as e:
                print(f"impl=python optimizer={name} kernels={kernels} params={which} not-available "
                      f"({str(e).splitlines()[0][:80]})")
                continue
            ms = []
            for _ in range(steps):
                start = time.perf_counter()
                opt.step()
                ms.append((time.perf_counter() - start) * 1000)
            print(f"impl=python optimizer={name} kernels={kernels} params={which} tensors={len(ps)} "
                  f"numel={sum(p.numel() for p in ps)} median_ms={statistics.median(ms):.2f} min_ms={min(ms):.2f}")


if __name__ == "__main__":
    with torch.no_grad():
        main()
