"""A complete DDP training script that ddpflow runs as it is, and that a bare torchrun runs too.

    torchrun --nproc_per_node 2 examples/train_ddp.py --epochs 5          # plain PyTorch: nothing else needed
    ddpflow run --config examples/train_ddp.yaml                          # scheduled, tracked, gated, served

It is written the way the PyTorch DDP tutorial teaches: ``init_process_group`` (gloo without a GPU), one GPU per
process from ``LOCAL_RANK``, ``DistributedDataParallel``, a ``DistributedSampler`` with ``set_epoch``, rank 0
saving a snapshot it resumes from. Five lines use ddpflow (``import ddpflow`` and the calls marked ``ddpflow:``):
its metrics reach the run's MLflow run, its model is registered behind the champion gate and served without this
file, a preemption or a cancelled run saves and stops cleanly, and the snapshot lives where the re-run finds it.
Under a bare torchrun those calls do nothing but say so once (``ddpflow.checkpoint_dir()``: ./checkpoints).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpflow


def synthetic(rows: int, seed: int) -> TensorDataset:
    """Two interleaved half-moons in 16 dimensions: a task a small MLP learns in a few epochs."""
    generator = torch.Generator().manual_seed(seed)
    label = torch.randint(0, 2, (rows,), generator=generator)
    angle = torch.rand(rows, generator=generator) * torch.pi
    x = torch.stack([torch.cos(angle) + label, torch.sin(angle) * (1 - 2 * label)], dim=1)
    noise = 0.3 * torch.randn(rows, 16, generator=generator)
    return TensorDataset(torch.cat([x, torch.zeros(rows, 14)], dim=1) + noise, label)


def accuracy(model: torch.nn.Module, loader: DataLoader, device: torch.device) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x.to(device)).argmax(dim=1) == y.to(device)).sum().item()
            total += len(y)
    model.train()
    return correct / total


def main(args: argparse.Namespace) -> None:
    on_gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    torch.manual_seed(0)

    train = synthetic(8192, seed=1)
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    test_loader = DataLoader(synthetic(2048, seed=2), batch_size=1024)
    model = torch.nn.Sequential(torch.nn.Linear(16, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, 2))
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    snapshot = ddpflow.checkpoint_dir() / "snapshot.pt"  # ddpflow: survives restarts and the re-run of a stop
    start = 0
    if snapshot.exists():
        state = torch.load(snapshot, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"]
        print(f"resuming from epoch {start}", flush=True)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if on_gpu else None)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
        test_accuracy = accuracy(model, test_loader, device)
        print(f"epoch {epoch}: train loss {loss.item():.4f}, test accuracy {test_accuracy:.4f}", flush=True)
        ddpflow.report({"train_loss": loss.item(), "test_accuracy": test_accuracy}, step=epoch)  # ddpflow: metrics
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1}, snapshot)
        dist.barrier()  # the snapshot is whole before any rank may stop
        if ddpflow.should_stop():  # ddpflow: a preemption, a cancelled run or a pruned trial, on every rank alike
            print(f"stopping after epoch {epoch}: the same command resumes from {snapshot}", flush=True)
            dist.destroy_process_group()
            return

    ddpflow.log_model(model, input_example=next(iter(test_loader))[0][:8])  # ddpflow: registered, then served
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="DDP training of a small MLP, with or without ddpflow")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=128, help="per rank")
    parser.add_argument("--lr", type=float, default=0.003)
    parser.add_argument("--hidden", type=int, default=64)
    main(parser.parse_args())
