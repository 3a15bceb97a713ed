"""A user's DDP training loop that uses ddpflow's API: it reports, checks ``ddpflow.should_stop()`` every step
(saving in ``ddpflow.checkpoint_dir()`` and returning when told), resumes from what it saved, and logs its model.

    torchrun --nproc_per_node 2 stoppable.py --steps 40 --lr 0.05 --sleep 0.1
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import ddpflow


def data(rows, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(rows, 8, generator=generator)
    return x, x @ torch.arange(1.0, 9.0).unsqueeze(1)


def main(args):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    saved = ddpflow.checkpoint_dir() / "state.pt"
    start = 0
    if saved.exists():
        state = torch.load(saved)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        print(f"resumed at step {start}", flush=True)
    ddp = DistributedDataParallel(model)
    x, y = data(512, seed=1)
    x_val, y_val = data(128, seed=2)
    for step in range(start, args.steps):
        rows = torch.arange(step * 32 + rank, step * 32 + 32, world) % len(x)
        optimizer.zero_grad()
        F.mse_loss(ddp(x[rows]), y[rows]).backward()
        optimizer.step()
        if (step + 1) % args.report_every == 0:
            with torch.no_grad():
                ddpflow.report({"val_loss": F.mse_loss(model(x_val), y_val).item()}, step=step)
        print(f"step {step} done", flush=True)
        time.sleep(args.sleep)
        if ddpflow.should_stop():
            if rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}, saved)
                print(f"stopping: saved step {step + 1}", flush=True)
            dist.barrier()
            dist.destroy_process_group()
            return
    with torch.no_grad():
        ddpflow.report({"test_loss": F.mse_loss(model(x_val), y_val).item()})
    ddpflow.log_model(model, input_example=x_val[:4])
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--report_every", type=int, default=5)
    main(parser.parse_args())
