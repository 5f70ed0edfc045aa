"""The PyTorch models of the benchmark peers, with the same layers and parameter names as
tandem's (`tandem_nn::models::lenet5`, `tandem_nn::resnet`, and `convnet()` in
`benches/ddp_step.rs`). Imported by the peers and by `tests/fixtures/make_resnet20_fixture.py`."""

from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F


def lenet5():
    """LeNet-5 with the same layers and parameter names as `tandem_nn::models::lenet5`."""
    return nn.Sequential(
        OrderedDict(
            features=nn.Sequential(
                nn.Conv2d(1, 6, 5, padding=2),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Conv2d(6, 16, 5),
                nn.ReLU(),
                nn.MaxPool2d(2),
            ),
            flatten=nn.Flatten(),
            classifier=nn.Sequential(
                nn.Linear(16 * 5 * 5, 120),
                nn.ReLU(),
                nn.Linear(120, 84),
                nn.ReLU(),
                nn.Linear(84, 10),
            ),
        )
    )


class BasicBlock(nn.Module):
    """ResNet basic block with an option-B (1x1 conv + bn) shortcut, as `tandem_nn::resnet`."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(out + shortcut)


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for 32x32 images with the same names as `tandem_nn::resnet`."""

    def __init__(self, depth=20, num_classes=10):
        super().__init__()
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        cin = 16
        for i, (c, s) in enumerate([(16, 1), (32, 2), (64, 2)]):
            blocks = []
            for j in range(n):
                blocks.append(BasicBlock(cin, c, s if j == 0 else 1))
                cin = c
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def convnet():
    """The mid-size CNN of `benches/ddp_step.rs` (`convnet()`), layer for layer."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


class Bottleneck(nn.Module):
    """torchvision's ResNet v1.5 bottleneck (stride on the 3x3 conv), same names as
    `tandem_nn::resnet_imagenet::Bottleneck`."""

    expansion = 4

    def __init__(self, cin, width, stride):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(out + shortcut)


class ResNet50(nn.Module):
    """ResNet-50 for 224x224 images with torchvision's layout and parameter names (used when
    torchvision itself is not installed; `tests/fixtures/resnet50_keys.txt` lists them)."""

    def __init__(self, num_classes=1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = 64
        for i, (width, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)]):
            layers = []
            for j in range(blocks):
                layers.append(Bottleneck(cin, width, (1 if i == 0 else 2) if j == 0 else 1))
                cin = width * Bottleneck.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*layers))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50():
    """torchvision's ResNet-50 when installed, otherwise the same network from `ResNet50`."""
    try:
        import torchvision

        return torchvision.models.resnet50(weights=None)
    except ImportError:
        return ResNet50()
