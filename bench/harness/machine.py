"""What the figures were measured on: recorded with every run, shown at the top of docs/benchmarks.md."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def machine_info() -> dict[str, Any]:
    """What the figures were measured on; recorded with every run."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    info["versions"] = _versions("torch", "pyarrow", "numpy", "pandas", "prefect", "mlflow")
    info["gpu"] = _gpu()
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _versions(*packages: str) -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for package in packages:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def _gpu() -> dict[str, Any] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return {
        "name": torch.cuda.get_device_name(0),
        "count": torch.cuda.device_count(),
        "cuda": torch.version.cuda,
        "bf16": torch.cuda.is_bf16_supported(),
    }
