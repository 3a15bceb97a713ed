"""A user's training script (tests/scripts/ddp_tutorial.py, the PyTorch DDP tutorial's way) and the variants the
flow tests make of it, each a few lines a user would add: ddpflow's three lines, a failure, a preemption-aware
loop. Written into the test's own directory, as a user's project holds its script."""

from __future__ import annotations

import hashlib
from pathlib import Path

TUTORIAL = Path(__file__).resolve().parents[1] / "scripts" / "ddp_tutorial.py"


def tutorial_text() -> str:
    return TUTORIAL.read_text()


def _edit(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"the tutorial script changed: {old!r} is not there once"
    return text.replace(old, new)


def with_three_lines(text: str) -> str:
    """``import ddpflow``, ``ddpflow.report`` of each epoch's test error, ``ddpflow.log_model`` at the end."""
    text = _edit(text, "import torch\n", "import torch\nimport ddpflow\n")
    text = _edit(
        text,
        '            print(f"Epoch {epoch} | test mse {test_mse:.5f}")\n',
        '            print(f"Epoch {epoch} | test mse {test_mse:.5f}")\n'
        '            ddpflow.report({"test_mse": test_mse}, step=epoch)\n',
    )
    return _edit(
        text,
        "    trainer.train(total_epochs)\n",
        "    trainer.train(total_epochs)\n    ddpflow.log_model(trainer.model, input_example=test_set[:4][0])\n",
    )


def failing_on_rank_one(text: str) -> str:
    """Rank 1 raises in epoch 1, from the script's own code."""
    return _edit(
        text,
        "    def _run_epoch(self, epoch):\n",
        "    def _run_epoch(self, epoch):\n"
        "        if self.global_rank == 1 and epoch == 1:\n"
        '            raise ValueError(f"bad batch in epoch {epoch}")\n',
    )


def killed_once(text: str) -> str:
    """Rank 1 is killed (SIGKILL, as the OOM killer does) in epoch 1 of torchrun's first attempt only, once rank 0
    has saved epoch 0's snapshot whole, that is once torch can load it (the tutorial has no barrier after its
    save: without the wait, the kill can stop rank 0 before it saves, and the restart begins from nothing)."""
    text = _edit(text, "import argparse\n", "import argparse\nimport signal\nimport time\n")
    return _edit(
        text,
        "    def _run_epoch(self, epoch):\n",
        "    def _run_epoch(self, epoch):\n"
        '        if self.global_rank == 1 and epoch == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":\n'
        "            while True:\n"
        "                try:\n"
        '                    torch.load(self.snapshot_path, map_location="cpu")\n'
        "                    break\n"
        "                except Exception:  # not there yet, or half written\n"
        "                    time.sleep(0.05)\n"
        "            os.kill(os.getpid(), signal.SIGKILL)\n",
    )


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
