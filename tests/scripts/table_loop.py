"""A user's own DDP loop over ddpflow's prepared data: ``ddpflow.dataset("train")`` with a plain
``DistributedSampler`` and ``DataLoader``, a model of the user's that follows the model contract (the batch dict
in, ``[B, n_outputs]`` out), and ``ddpflow.log_model(model)``: ddpflow evaluates, gates and serves it.

Each rank writes the rows its sampler gave it, per epoch, to ``checkpoint_dir()/seen-rank<R>.json``.
"""

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import ddpflow


class TableModel(nn.Module):
    """Every float entry of the batch (numeric inputs, missing indicators, vectors) side by side, an embedding for
    every integer one (categoricals, hashed ids: their cardinality is in ``inputs``)."""

    def __init__(self, inputs, n_outputs, item):
        super().__init__()
        self.floats = sorted(name for name, value in item.items() if name != "label" and value.is_floating_point())
        codes = sorted(name for name, value in item.items() if name != "label" and not value.is_floating_point())
        self.embeddings = nn.ModuleDict({name: nn.Embedding(inputs[name].cardinality, 4) for name in codes})
        width = sum(item[name].numel() for name in self.floats) + 4 * len(codes)
        self.net = nn.Sequential(nn.Linear(width, 32), nn.ReLU(), nn.Linear(32, n_outputs))

    def forward(self, batch):
        floats = [batch[name].reshape(batch[name].shape[0], -1) for name in self.floats]
        codes = [embedding(batch[name]) for name, embedding in self.embeddings.items()]
        return self.net(torch.cat(floats + codes, dim=1))


def main(args):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    train = ddpflow.dataset("train")
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    model = TableModel(train.inputs, train.n_outputs, train[0])
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    seen = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        seen.append(list(sampler))
        for batch in loader:
            optimizer.zero_grad()
            F.cross_entropy(ddp(batch), batch["label"]).backward()
            optimizer.step()
        print(f"epoch {epoch} done", flush=True)
    (ddpflow.checkpoint_dir() / f"seen-rank{rank}.json").write_text(json.dumps(seen))
    ddpflow.log_model(model)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    main(parser.parse_args())
