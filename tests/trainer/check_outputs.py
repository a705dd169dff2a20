"""Opens what ctorch-train wrote with Debian's PyTorch: the snapshot (torch.load), its model state in
the Python twin of the model (models/python/ctorch_models.py, load_state_dict strict), the final
weights, and a checkpoint. Usage: check_outputs.py <run dir> <source dir>"""
import os
import sys

import torch

run, source = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(source, "models", "python"))
from ctorch_models import MnistCnn  # noqa: E402


def load(path):
    # PyTorch 1.13's weights-only loader lacks BINFLOAT; later versions load with weights_only=True.
    if torch.__version__.startswith("1."):
        return torch.load(path)
    return torch.load(path, weights_only=True)


snap = load(os.path.join(run, "snapshot.pt"))
header = snap["CTORCH_SNAPSHOT"]
assert header["magic"] == "ctorch-snapshot", header
assert header["model_name"] == "mnist-cnn", header
assert header["config"]["model"] == "mnist-cnn", header["config"]
assert snap["OPTIMIZER_TYPE"] == "SGD"
model = MnistCnn()
model.load_state_dict(snap["MODEL_STATE"], strict=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
optimizer.load_state_dict(snap["OPTIMIZER_STATE"])
print(f"snapshot ok: EPOCHS_RUN {snap['EPOCHS_RUN']} GLOBAL_STEP {snap['GLOBAL_STEP']} "
      f"keys {sorted(snap.keys())}")

weights = load(os.path.join(run, "model.pt"))
MnistCnn().load_state_dict(weights, strict=True)
for name, tensor in snap["MODEL_STATE"].items():
    assert torch.equal(tensor, weights[name]), name  # the final weights are the last snapshot's
print("model.pt loads into ctorch_models.MnistCnn")

checkpoint = load(os.path.join(run, "checkpoint_epoch_2.pt"))
assert checkpoint["EPOCHS_RUN"] == 2
print("checkpoint ok")
