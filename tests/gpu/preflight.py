"""``make test-gpu`` refuses to pass where there is nothing to test: exit status 2 and
the reason where torch sees no CUDA GPU (a CPU build of torch, no driver, or
``CUDA_VISIBLE_DEVICES`` hiding them), else one line naming the GPUs and what runs.

    python tests/gpu/preflight.py
"""

from __future__ import annotations

import sys


def why_not() -> str | None:
    """Why the GPU tests cannot run here (None: they can)."""
    import os

    import torch

    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is a CPU build: install a CUDA build of torch 2.13 "
                f"(make venv VENV_SYSTEM_TORCH=1 with a CUDA torch on the system)")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        return ("torch sees no CUDA GPU" + (f" (CUDA_VISIBLE_DEVICES={hidden!r})" if hidden is not None else "")
                + f": torch {torch.__version__}, CUDA {torch.version.cuda}; check nvidia-smi and the driver")
    return None


def main() -> int:
    reason = why_not()
    if reason is not None:
        print(f"make test-gpu: {reason}", file=sys.stderr)
        return 2
    import torch

    n = torch.cuda.device_count()
    print(f"make test-gpu: {n} GPU(s) ({torch.cuda.get_device_name(0)}); the modes that divide {n} ranks run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
