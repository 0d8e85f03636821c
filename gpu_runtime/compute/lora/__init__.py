"""Multi-LoRA: the layer (`layer.py`), the model surgery that puts it in a base (`wrap.py`) and the kernels with their
torch references and the choice per device and dtype (`ops.py`). New kernels go in `ops.py`, and nowhere else."""
