"""PyTorch twins of ctorch::models (models/src/*.cpp): the same architectures with the same
submodule names, so a state dict written by ctorch::models::saveStateDict loads with
load_state_dict(strict=True). Used by the benchmarks that compare against the Python peer.

Run with Debian's PyTorch: /usr/bin/python3 (the python3 on PATH may have no torch).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

MODEL_NAMES = ("linear", "mnist-cnn", "simple-cnn", "resnet18")


class MnistCnn(nn.Module):
    """PyTorch's examples/mnist Net (the seeds' model), with adjustable input size/channels."""

    def __init__(self, in_channels=1, num_classes=10, image_size=28):
        super().__init__()
        pooled = (image_size - 4) // 2
        self.conv1 = nn.Conv2d(in_channels, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(64 * pooled * pooled, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


class SimpleConvNet(nn.Module):
    """PyTorch's CIFAR-10 tutorial Net with adjustable input size/channels; returns logits."""

    def __init__(self, in_channels=3, num_classes=10, image_size=32):
        super().__init__()
        s = ((image_size - 4) // 2 - 4) // 2
        self.conv1 = nn.Conv2d(in_channels, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * s * s, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class BasicBlock(nn.Module):
    def __init__(self, in_planes, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or in_planes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out = out + (self.downsample(x) if self.downsample is not None else x)
        return F.relu(out)


class ResNet18(nn.Module):
    """ResNet-18 with the CIFAR stem (3x3 stride-1 conv, no max-pool); torchvision's names."""

    def __init__(self, in_channels=3, num_classes=10):
        super().__init__()
        self.in_planes = 64
        self.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.layer1 = self._layer(64, 2, 1)
        self.layer2 = self._layer(128, 2, 2)
        self.layer3 = self._layer(256, 2, 2)
        self.layer4 = self._layer(512, 2, 2)
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _layer(self, planes, blocks, stride):
        layers = []
        for i in range(blocks):
            layers.append(BasicBlock(self.in_planes, planes, stride if i == 0 else 1))
            self.in_planes = planes
        return nn.Sequential(*layers)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = F.adaptive_avg_pool2d(x, 1)
        return self.fc(torch.flatten(x, 1))


def create_model(name, in_channels=1, num_classes=10, image_size=28, in_features=20, out_features=1):
    """The Python side of ctorch::models::createModel (same names, same options)."""
    if name == "linear":
        return nn.Linear(in_features, out_features)  # the torchrun tutorial's model itself
    if name == "mnist-cnn":
        return MnistCnn(in_channels, num_classes, image_size)
    if name == "simple-cnn":
        return SimpleConvNet(in_channels, num_classes, image_size)
    if name == "resnet18":
        return ResNet18(in_channels, num_classes)
    raise ValueError(f"unknown model '{name}' (known: {', '.join(MODEL_NAMES)})")
