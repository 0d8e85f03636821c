"""What runs a pass, on plain data in and out (`plan.py`): the training step, losses, batches, the optimizer,
decoding and sampling, models, the base pool, quantization, merging, sharding and ranks. Torch lives here. It never
imports `engine/` (a test walks the imports); the engine imports it."""

import logging

# bitsandbytes' CPU backend warns at import (peft imports it) that the optional `kernels` package is missing, and
# falls back to its own kernel: nothing a CPU user can act on, printed at every runtime start.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
