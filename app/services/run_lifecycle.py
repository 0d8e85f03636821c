"""A run's life (RunLifecycle): creating one (from a catalogue base or a checkpoint), deleting one with its rows,
and the runtime's own state, which names every run (admins only)."""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import delete

from app.errors import BadInput, RunNotFound
from app.services.deadlines import Deadline
from app.services.run_calls import RunCalls, pool_of
from app.services.run_checkpoints import RunCheckpoints
from app.services.run_specs import RunSpec, default_run_name
from app.services.users import require_admin
from app.tables import Checkpoint, Metric, Run, Sample, User, new_id, utcnow
from gpu_runtime.client.allocation import PoolKey
from gpu_runtime.contract import LORA_SWITCHES, CreateRun, DeleteRun, RuntimeState, checkpoint_ref, target_families
from gpu_runtime.contract.json_types import JSONObject
from gpu_runtime.contract.training_settings import LoraSettings


class RunLifecycle:
    def __init__(self, calls: RunCalls, saves: RunCheckpoints) -> None:
        self.calls = calls
        self.saves = saves  # a run created from a checkpoint reads its row

    async def create(self, user: User, spec: RunSpec) -> Run:
        deadline = Deadline.start(self.calls.deadlines, "create_run")  # a model load included
        spec.validate()
        source = None
        if spec.from_checkpoint is not None:  # inherits the checkpoint's base, seed, step and LoRA settings
            ref = checkpoint_ref(spec.from_checkpoint, "fromCheckpoint")
            source, _ = await self.saves.checkpoint_row(user, ref, "fromCheckpoint")
            if spec.base_model and spec.base_model != source.base_model:
                raise BadInput(f"baseModel: the checkpoint was trained on {source.base_model!r}, not "
                               f"{spec.base_model!r}", field="baseModel")
        model = self.calls.catalog.get(spec.base_model or (source.base_model if source else self.calls.default_model))
        lora = source.lora_config if source else spec.lora()  # only read: the row's dict is not changed
        adam = spec.adam()
        requested_quantization = spec.quantization or (source.quantization or None if source else None)
        # Checked to hold the model, quantized or not; then the quantization it was checked with.
        families: dict[str, bool] = (target_families(lora["target_modules"]) if "train_attn" not in lora
                    else {s: bool(lora.get(s)) for s in LORA_SWITCHES})
        gpu_config = self.calls.catalog.resolve_gpu(model, spec.gpu_config, requested_quantization, lora_r=lora["r"],
                                              targets=model.lora_targets(families))
        quantization = self.calls.catalog.resolve_quantization(model, requested_quantization)
        run_id = new_id()
        await self.calls.ledger.allow_create(user, run_id, gpu_config, model.name)
        request = CreateRun(  # from a checkpoint: only the LoRA settings given, which must agree with its own
            run_id=run_id, user_id=user.id, base_model=model.source, quantization=quantization,
            lora=spec.explicit_lora() if source else lora, seed=spec.seed if source else spec.seed or 0,
            from_checkpoint=spec.from_checkpoint if source else None,
            with_optimizer=spec.with_optimizer if source else True)
        pool = PoolKey.of(model.name, gpu_config, quantization)
        # A create_run is named by its run.
        created = await self.calls.answered(deadline, pool, user, run_id, self.calls.engine(request, pool=pool))
        # The runtime resolved the switches against the model: the run keeps the layers they named.
        kept = created.lora or lora
        stored: LoraSettings = {"r": kept["r"], "alpha": kept["alpha"], "dropout": kept["dropout"],
                                "target_modules": created.target_modules}
        run = Run(
            id=run_id,
            user_id=user.id,
            base_model=model.name,
            lora_config=stored,
            optimizer_config=adam,
            seed=created.seed,
            step=created.step,
            gpu_config=gpu_config,
            device=created.device,
            quantization=quantization or "",
            trainable_params=created.trainable_params,
            total_params=created.total_params,
            **({"name": default_run_name(model.name, utcnow())} | spec.labels().checked()),
        )
        async with self.calls.db.session() as session:
            session.add(run)
        return run

    async def delete(self, user: User, run_id: str) -> None:
        run = await self.calls.get(user, run_id)

        async def work(ticket: int, sent: Callable[[], None]) -> None:
            try:  # after the run's calls before it
                await self.calls.engine(DeleteRun(run_id=run.id), pool=pool_of(run), ticket=ticket, sent=sent)
            except RunNotFound:
                pass  # its files are already gone (an earlier delete half done): remove the rows anyway
            async with self.calls.db.session() as session:
                for table in (Metric, Sample, Checkpoint):
                    await session.execute(delete(table).where(table.run_id == run.id))
                await session.execute(delete(Run).where(Run.id == run.id))

        await self.calls.in_order(run.id, work)
        self.calls.order.forget(run.id)

    async def runtime_state(self, user: User) -> JSONObject:
        """What the GPU runtime holds and does (bases, resident and evicted runs, queues, ticks): admins only,
        since it names every user's runs."""
        require_admin(user, "read the runtime's state")
        return (await self.calls.backend.call(RuntimeState())).state
