"""The runtime process's bookkeeping: it queues, orders, journals and answers. The tick, the scheduler and its
tickets, calls in flight, the training, sampling and control calls, checkpoints, the journal, snapshots, recovery and
run state with its files. It may import `contract`, `client`, `errors` and `compute`; only the entry points
(`runtime_process`, `modal_app`) and tests import it."""
