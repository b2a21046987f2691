"""Where a measurement ran: device, driver, library versions, git sha."""

from __future__ import annotations

import os
import platform
import subprocess

import torch

import pqattn


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device: 'cuda' was asked for but torch sees no CUDA device; use --device auto or cpu"
        )
    return device


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _command(*argv: str) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _git_sha() -> str | None:
    """HEAD of the checkout; PQATTN_GIT_SHA names it where the copy has no .git (the GPU machine)."""
    return os.environ.get("PQATTN_GIT_SHA") or _command("git", "rev-parse", "HEAD")


def l2_bytes(device: torch.device) -> int:
    """Last-level cache of the GPU (0 on the CPU, where the lab does not rotate inputs)."""
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20))


def environment(device: torch.device) -> dict:
    env = {
        "git_sha": _git_sha(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pqattn": pqattn.__version__,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
        "cuda": torch.version.cuda,
        "driver": _first_line(_command("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"))
        if device.type == "cuda"
        else None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["compute_capability"] = f"{props.major}.{props.minor}"
        env["sm_count"] = props.multi_processor_count
        env["l2_bytes"] = l2_bytes(device)
        env["memory_bytes"] = props.total_memory
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def _first_line(text: str | None) -> str | None:
    """The first line of a command's output (nvidia-smi prints one line per GPU)."""
    return text.splitlines()[0] if text else None
