"""`python -m gpu_runtime.worker`: the runtime process under its first name, kept for deployments and scripts
that start it so. The code is gpu_runtime/runtime_process.py."""

from __future__ import annotations

import sys

from gpu_runtime.runtime_process import main

if __name__ == "__main__":
    sys.exit(main())
