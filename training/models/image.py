"""The built-in image model (``train.model: auto`` on an image input): a small residual CNN per image input,
its pooled features joined with any tabular inputs (numeric, vector, embedded), then one linear head.

It normalises with GroupNorm, never BatchNorm: a BatchNorm's statistics are those of each rank's share of the
batch, so 1 rank x 2b and 2 ranks x b would train different weights; GroupNorm's are per row, and the exact
update holds at any world size (tests/training/test_images.py). Only Pillow and torch: no torchvision.

    model_kwargs: {width: 32, blocks: [1, 1, 1], groups: 8, embedding_dims: {country: 4}}

Stage ``s`` has ``width * 2**s`` channels and ``blocks[s]`` residual blocks, every stage after the first
halving the resolution. On a GPU the trainer keeps the weights and the images channels_last (faster
convolutions under bf16); the arithmetic is the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from training.kinds.base import DENSE, EMBEDDING, PIXELS
from training.kinds.inputs import InputInfo, block_names
from training.kinds.registry import block_of, inputs_in
from training.models.tabular import TABULAR_BLOCKS, embedding_dim, numeric_block


def group_norm(channels: int, groups: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(groups, channels), channels)


class ResidualBlock(nn.Module):
    """conv3x3 -> GN -> ReLU -> conv3x3 -> GN, plus the input (a strided 1x1 conv + GN when the shape changes)."""

    def __init__(self, channels_in: int, channels_out: int, stride: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = group_norm(channels_out, groups)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False)
        self.norm2 = group_norm(channels_out, groups)
        self.shortcut = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride=stride, bias=False), group_norm(channels_out, groups)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(self.norm2(self.conv2(out)) + self.shortcut(x))


class ImageTrunk(nn.Module):
    """[B, C, H, W] -> [B, width * 2**(stages - 1)]: a stem, the residual stages, a global average pool."""

    def __init__(self, channels: int, width: int, blocks: Sequence[int], groups: int):
        super().__init__()
        layers: list[nn.Module] = [
            nn.Conv2d(channels, width, 3, padding=1, bias=False),
            group_norm(width, groups),
            nn.ReLU(),
        ]
        current = width
        for stage, count in enumerate(blocks):
            out = width * 2**stage
            for block in range(int(count)):
                layers.append(ResidualBlock(current, out, 2 if stage > 0 and block == 0 else 1, groups))
                current = out
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.features = current

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(self.layers(x)), 1)


class ImageClassifier(nn.Module):
    def __init__(
        self,
        inputs: dict[str, InputInfo],
        n_outputs: int,
        width: int = 32,
        blocks: Sequence[int] = (1, 1, 1),
        groups: int = 8,
        embedding_dims: dict[str, int] | None = None,
    ):
        super().__init__()
        takes = (*TABULAR_BLOCKS, PIXELS)
        unknown = [f"{name} ({info.kind})" for name, info in inputs.items() if block_of(info) not in takes]
        if unknown:
            raise ValueError(f"the built-in image model takes images and tabular inputs, not {unknown}")
        self.images = inputs_in(inputs, PIXELS)
        self.trunks = nn.ModuleDict(
            {name: ImageTrunk(inputs[name].shape[0], width, blocks, groups) for name in self.images}
        )
        self.numeric = block_names(inputs)  # the numeric inputs, then their missing indicators
        self.vectors = inputs_in(inputs, DENSE)
        self.embedded = inputs_in(inputs, EMBEDDING)
        self.embeddings = nn.ModuleDict(
            {
                name: nn.Embedding(
                    inputs[name].cardinality,
                    int((embedding_dims or {}).get(name, embedding_dim(inputs[name].cardinality))),
                )
                for name in self.embedded
            }
        )
        joined = sum(trunk.features for trunk in self.trunks.values()) + len(self.numeric)
        joined += sum(inputs[name].shape[0] for name in self.vectors)
        joined += sum(embedding.embedding_dim for embedding in self.embeddings.values())
        self.head = nn.Linear(joined, n_outputs)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = [self.trunks[name](_image_layout(batch[name])) for name in self.images]
        if self.numeric:
            parts.append(numeric_block(batch, self.numeric))
        parts += [batch[name] for name in self.vectors]
        parts += [self.embeddings[name](batch[name]) for name in self.embedded]
        return self.head(torch.cat(parts, dim=1))


def _image_layout(images: torch.Tensor) -> torch.Tensor:
    """channels_last on a GPU (the weights are too: training/distributed/context.py), as the batch comes elsewhere."""
    if images.device.type == "cuda":
        return images.contiguous(memory_format=torch.channels_last)
    return images


def image_classifier(inputs: dict[str, InputInfo], n_outputs: int, **kwargs) -> ImageClassifier:
    return ImageClassifier(inputs, n_outputs, **kwargs)
