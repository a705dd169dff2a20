"""The Python peer of ctorch-train for bench/trainer_vs_python.sh: the seeds' MNIST CNN
(models/python/ctorch_models.py, same layers as ctorch::models::MnistCnn) on Fashion-MNIST with
PyTorch's own DistributedDataParallel, DistributedSampler and DataLoader, SGD with momentum and
StepLR(1, 0.7) as ctorch-train's defaults, batch 64 per rank -- what a PyTorch user would write.
Run under torchrun with Debian's PyTorch:

  torchrun --standalone --nproc_per_node 2 -r 1 -t 1 --log_dir D bench/trainer/python_peer.py --epochs 1

Data paths (--data):
  per-sample  a Dataset holding the uint8 images whose __getitem__ converts one image the way
              torchvision's ToTensor + Normalize do (the seeds' scripts), DataLoader collates;
  preloaded   the whole set converted and normalised once into a TensorDataset (the fastest
              plain-PyTorch path), DataLoader collates.
  synthetic   --model resnet18: random 3x32x32 images (CIFAR-shaped) and labels, as ctorch-train's
              synthetic-images, preloaded (what is measured is the model's step, not the data).
Prints one JSON line per epoch on rank 0: train seconds, samples/s, test accuracy.
"""
import argparse
import gzip
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "models", "python"))
from ctorch_models import MnistCnn, create_model  # noqa: E402

MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST, as ctorch::data


def read_idx(path):
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape).copy())


class PerSample(Dataset):
    """ToTensor + Normalize per image, as torchvision.datasets.FashionMNIST with transforms does."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = self.images[i].unsqueeze(0).float().div(255)
        return (x - MEAN) / STD, int(self.labels[i])


def make_dataset(images, labels, mode):
    if mode == "per-sample":
        return PerSample(images, labels)
    x = (images.unsqueeze(1).float().div(255) - MEAN) / STD
    return TensorDataset(x, labels.long())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--data", choices=["per-sample", "preloaded", "synthetic"], default="per-sample")
    p.add_argument("--model", choices=["mnist-cnn", "resnet18"], default="mnist-cnn")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--gamma", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--train-limit", type=int, default=0)
    p.add_argument("--test-limit", type=int, default=0)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.data == "synthetic":
        g = torch.Generator().manual_seed(args.seed)
        n_train, n_test = args.train_limit or 51200, args.test_limit or 512
        train = TensorDataset(torch.randn(n_train, 3, 32, 32, generator=g), torch.randint(0, 10, (n_train,), generator=g))
        test = TensorDataset(torch.randn(n_test, 3, 32, 32, generator=g), torch.randint(0, 10, (n_test,), generator=g))
    else:
        d = args.data_dir
        train_x = read_idx(os.path.join(d, "train-images-idx3-ubyte.gz"))
        train_y = read_idx(os.path.join(d, "train-labels-idx1-ubyte.gz")).long()
        test_x = read_idx(os.path.join(d, "t10k-images-idx3-ubyte.gz"))
        test_y = read_idx(os.path.join(d, "t10k-labels-idx1-ubyte.gz")).long()
        if args.train_limit:
            train_x, train_y = train_x[:args.train_limit], train_y[:args.train_limit]
        if args.test_limit:
            test_x, test_y = test_x[:args.test_limit], test_y[:args.test_limit]
        train = make_dataset(train_x, train_y, args.data)
        test = make_dataset(test_x, test_y, args.data)

    torch.manual_seed(args.seed)
    model = MnistCnn() if args.model == "mnist-cnn" else create_model(args.model, in_channels=3, image_size=32)
    # The CNN ends in log_softmax (nll_loss); ResNet-18 gives logits.
    loss_of = F.nll_loss if args.model == "mnist-cnn" else F.cross_entropy
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    # ctorch-train's default schedule, the seeds' MNIST example's: x0.7 after every epoch.
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    # Evaluation: each rank a contiguous share of the test set, counts all-reduced (as ctorch-train).
    n = len(test)
    share = range(rank * n // world, (rank + 1) * n // world)
    test_loader = DataLoader(torch.utils.data.Subset(test, share), batch_size=1000)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        start, cpu_start = time.perf_counter(), time.process_time()
        samples = 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_of(ddp(x), y)
            loss.backward()
            optimizer.step()
            samples += len(y)
        train_seconds = time.perf_counter() - start
        cpu_seconds = time.process_time() - cpu_start
        scheduler.step()
        ddp.eval()
        eval_start = time.perf_counter()
        totals = torch.zeros(3, dtype=torch.float64)
        with torch.no_grad():
            for x, y in test_loader:
                out = model(x)
                totals[0] += loss_of(out, y, reduction="sum").item()
                totals[1] += (out.argmax(1) == y).sum().item()
                totals[2] += len(y)
        dist.all_reduce(totals)
        eval_seconds = time.perf_counter() - eval_start
        if rank == 0:
            print(json.dumps({"impl": "python", "data": args.data, "world": world, "epoch": epoch + 1,
                              "train_seconds": train_seconds, "cpu_seconds": cpu_seconds,
                              "samples_per_s": samples * world / train_seconds,
                              "eval_seconds": eval_seconds, "test_loss": totals[0].item() / totals[2].item(),
                              "test_accuracy": totals[1].item() / totals[2].item(),
                              "threads": torch.get_num_threads()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
