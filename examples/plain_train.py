"""Classify points of a noisy two-arm spiral with a small MLP (PyTorch, one machine).

Run: python examples/plain_train.py [--epochs 20] [--seed 0]
"""

import argparse
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_spiral(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` points (x, y) on two interleaved spiral arms with noise; the label is the arm."""
    g = torch.Generator().manual_seed(seed)
    label = torch.randint(0, 2, (n,), generator=g)
    angle = 0.5 + 3 * math.pi * torch.rand(n, generator=g)
    radius = angle / (3 * math.pi)
    turn = angle + math.pi * label
    points = torch.stack([radius * torch.cos(turn), radius * torch.sin(turn)], dim=1)
    return points + 0.04 * torch.randn(n, 2, generator=g), label


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="seeds the model and the shuffling")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    x, y = make_spiral(4000, seed=0)
    x_test, y_test = make_spiral(1000, seed=1)  # held out: never trained on
    model = build_model()
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(args.epochs):
        for batch in loader:
            optimizer.zero_grad()
            loss_fn(model, batch).backward()
            optimizer.step()
    print(f"held-out accuracy {accuracy(model, x_test, y_test):.3f}")


if __name__ == "__main__":
    main()
