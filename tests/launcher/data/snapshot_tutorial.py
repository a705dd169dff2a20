# The seeds' torchrun tutorial (pytorch/examples, distributed/ddp-tutorial-series/
# multigpu_torchrun.py) on CPU/gloo: a Trainer that resumes from snapshot.pt ({"MODEL_STATE",
# "EPOCHS_RUN"}), a DistributedSampler, DDP over Linear(20, 1), SGD(lr=1e-3), batch 32.
# Three changes, so that a check of its result can fail:
# - the loss is mse_loss: the tutorial's cross_entropy over a single output is identically 0, so its
#   model never changes and every run "ends bit-identical";
# - EPOCHS_RUN is the number of epochs done (epoch + 1): the tutorial stores the epoch it just ran and
#   runs it again after a restart (set TUTORIAL_REPLAY_BUG=1 to get that back: the control);
# - the snapshot is written to a temporary file and renamed, so a worker killed mid-save by the
#   launcher's restart leaves the previous snapshot whole.
# Fault: CRASH_RANK / CRASH_EPOCH make that rank exit 13 at the start of that epoch in the first
# round only (TORCHELASTIC_RESTART_COUNT 0). Rank 0 prints "DIGEST <sha256 of the parameters>".
# Usage: snapshot_tutorial.py TOTAL_EPOCHS SAVE_EVERY SNAPSHOT_PATH
import hashlib
import os
import sys

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        generator = torch.Generator().manual_seed(1234)
        self.data = [(torch.rand(20, generator=generator), torch.rand(1, generator=generator)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print("Loading snapshot", flush=True)
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location="cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}", flush=True)

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        if (os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
                and os.environ.get("CRASH_RANK") == str(self.rank)
                and os.environ.get("CRASH_EPOCH") == str(epoch)):
            print(f"[rank {self.rank}] crashing at epoch {epoch}", flush=True)
            os._exit(13)
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch):
        done = epoch if os.environ.get("TUTORIAL_REPLAY_BUG") == "1" else epoch + 1
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": done}
        tmp = self.snapshot_path + ".tmp"
        torch.save(snapshot, tmp)
        os.replace(tmp, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}", flush=True)

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def main(total_epochs, save_every, snapshot_path, batch_size=32):
    init_process_group(backend="gloo")
    torch.manual_seed(0)
    dataset = MyTrainDataset(512)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    train_data = DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset))
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    if trainer.rank == 0:
        digest = hashlib.sha256()
        for p in trainer.model.module.parameters():
            digest.update(p.detach().contiguous().numpy().tobytes())
        print(f"DIGEST {digest.hexdigest()}", flush=True)
    destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
