"""What accelerators torch sees on this machine, asked through the door (a replay sees the same)."""
from __future__ import annotations

import sys


def cuda_device_count(door) -> int:
    """CUDA devices torch sees here (0 when torch has no CUDA or the probe fails)."""
    probe = door.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                     timeout=120, check=False)
    text = probe.stdout.strip()
    return int(text) if probe.ok and text.isdigit() else 0
