"""Loads state dicts written by ctorch::models::saveStateDict into ctorch_models.py's twins and checks
that the Python forward pass gives the C++ output on the same input.

Usage: /usr/bin/python3 check_equivalence.py DIR NAME:IN_CHANNELS:CLASSES:IMAGE_SIZE ...
DIR holds NAME.state.pt (the state dict) and NAME.io.pt (a dict with "input" and "output").
Exits 1 if a model's outputs differ by more than TOLERANCE, if a key is missing or unexpected
(load_state_dict strict), or if the control (one weight perturbed) is NOT detected.
"""
import os
import sys

import torch

import ctorch_models

# Both sides run the same float32 kernels of the same LibTorch build; different summation order
# (threads, blocking) changes results by a few ulps of values of order 1-10, far below 1e-4.
TOLERANCE = 1e-4


def main():
    folder, specs = sys.argv[1], sys.argv[2:]
    torch.set_grad_enabled(False)
    failed = False
    for spec in specs:
        name, channels, classes, size = spec.split(":")
        model = ctorch_models.create_model(name, in_channels=int(channels), num_classes=int(classes),
                                           image_size=int(size))
        state = torch.load(os.path.join(folder, name + ".state.pt"))
        # The test's own input/output file (torch::pickle_save, type-tagged): not weights-only.
        io = torch.load(os.path.join(folder, name + ".io.pt"), weights_only=False)
        model.load_state_dict(state, strict=True)
        model.eval()
        keys_in_order = list(state.keys()) == list(model.state_dict().keys())
        diff = (model(io["input"]) - io["output"]).abs().max().item()
        # Control: the comparison must notice one changed weight.
        first = next(iter(model.parameters()))
        first.add_(0.05)
        control = (model(io["input"]) - io["output"]).abs().max().item()
        ok = diff <= TOLERANCE and control > TOLERANCE and keys_in_order
        failed |= not ok
        print(f"{name}: max abs diff {diff:.3g} (tolerance {TOLERANCE}), control {control:.3g}, "
              f"{len(state)} keys in Python's order: {keys_in_order} -> {'ok' if ok else 'FAIL'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
