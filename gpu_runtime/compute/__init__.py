"""What runs a pass, on plain data in and out (`plan.py`): the training step, losses, batches, the optimizer,
decoding and sampling, models, the base pool, quantization, merging, sharding and ranks. Torch lives here. It never
imports `engine/` (a test walks the imports); the engine imports it."""
