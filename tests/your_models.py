"""Models as a user would hand them to ``python -m minishard.plan --model tests/your_models.py:NAME``
(observe/models.py): written here, apart from the planner, in the plain style of a training
script. Each function returns the dict the planner takes."""
import math

import torch
import torch.nn.functional as F
from torch import nn


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class SmallConvNet(nn.Module):
    """A CIFAR-sized classifier: three conv blocks with BatchNorm, pooling, a linear head."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = ConvBlock(3, 16)
        self.body = nn.Sequential(ConvBlock(16, 32), nn.MaxPool2d(2), ConvBlock(32, 32))
        self.head = nn.Linear(32, classes)

    def forward(self, images):
        x = self.body(self.stem(images))
        return self.head(x.mean(dim=(2, 3)))


def conv_net():
    images = torch.randn(64, 3, 32, 32)
    labels = torch.randint(0, 10, (64,))
    return {"model": SmallConvNet(), "batch": images, "units": {ConvBlock},
            "loss": lambda logits: F.cross_entropy(logits, labels)}


class DecoderLayer(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.feed_forward = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                          nn.Linear(4 * width, width))

    def forward(self, x):
        t = x.shape[1]
        causal = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.feed_forward(self.norm2(x))


class TinyLM(nn.Module):
    """A decoder-only language model whose output layer shares the embedding's weight, returning
    (logits, loss) as nanoGPT's does."""

    def __init__(self, vocab: int = 256, width: int = 64, heads: int = 4, layers: int = 3,
                 context: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(context, width) / math.sqrt(width))
        self.layers = nn.ModuleList(DecoderLayer(width, heads) for _ in range(layers))
        self.final_norm = nn.LayerNorm(width)
        self.unembed = nn.Linear(width, vocab, bias=False)
        self.unembed.weight = self.embed.weight  # tied

    def forward(self, tokens, targets):
        x = self.embed(tokens) + self.position[:tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        logits = self.unembed(self.final_norm(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tied_gpt():
    tokens = torch.randint(0, 256, (16, 33))
    return {"model": TinyLM(), "batch": (tokens[:, :-1], tokens[:, 1:]),
            "units": {DecoderLayer}, "loss": lambda out: out[1]}


def tied_gpt_on_meta():
    with torch.device("meta"):
        model = TinyLM(vocab=50304, width=768, heads=12, layers=12, context=1024)
        tokens = torch.empty(8, 1025, dtype=torch.long)
    return {"model": model, "batch": (tokens[:, :-1], tokens[:, 1:]), "units": DecoderLayer}


# ------------------------------------------------------------------ mistakes a user makes
def returns_a_tuple():
    return SmallConvNet(), torch.randn(2, 3, 8, 8)


def no_loss_for_a_tuple_output():
    tokens = torch.randint(0, 256, (2, 9))
    return {"model": TinyLM(), "batch": (tokens[:, :-1], tokens[:, 1:])}


def units_not_in_the_model():
    return {"model": SmallConvNet(), "batch": torch.randn(2, 3, 8, 8), "units": {DecoderLayer}}
