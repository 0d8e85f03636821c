"""Queries: thin resolvers over the services."""

from __future__ import annotations

import strawberry
from strawberry.scalars import JSON

from app.schema.account import ApiKey, UsageReport, User
from app.schema.catalog import Limits, ModelInfo, TokenizerInfo
from app.schema.context import Info
from app.schema.enums import DEFAULT_LOSS, LossFn
from app.schema.inputs import BatchItem, batch_items
from app.schema.results import Datum
from app.schema.runs import BaseSample, Run, RunSort
from app.services.usage import DEFAULT_DAYS


@strawberry.type
class Query:
    @strawberry.field(description="Base models runs may be created on")
    def models(self, info: Info) -> list[ModelInfo]:
        return [ModelInfo.from_catalog(model) for model in info.context.services.catalog.list()]

    @strawberry.field(description="What this server accepts in one call (the SDK splits larger batches)")
    def limits(self, info: Info) -> Limits:
        return Limits(max_batch_size=info.context.services.settings.max_batch_size)

    @strawberry.field
    async def me(self, info: Info) -> User:
        return User.from_row(await info.context.user())

    @strawberry.field(description="The caller's runs, newest first unless sorted; search: those whose name, base model "
                      "or a tag contains it (any case); archived: false (default) those not archived, true the "
                      "archived ones, null both")
    async def runs(self, info: Info, limit: int = 50, search: str = "", sort: RunSort = RunSort.NEWEST,
                   archived: bool | None = False) -> list[Run]:
        user = await info.context.user()
        rows = await info.context.services.runs.list(user, limit=limit, search=search, sort=sort.value,
                                                     archived=archived)
        return [Run.from_row(row) for row in rows]

    @strawberry.field(description="The caller's stored samples of base models alone (a /v1 request on a catalogue "
                      "model, sample(baseModel, store: true)), newest first")
    async def base_samples(self, info: Info, limit: int = 100) -> list[BaseSample]:
        user = await info.context.user()
        return [BaseSample.from_row(row) for row in await info.context.services.runs.base_samples(user, limit=limit)]

    @strawberry.field
    async def run(self, info: Info, id: strawberry.ID) -> Run:
        user = await info.context.user()
        return Run.from_row(await info.context.services.runs.get(user, str(id)))

    @strawberry.field(description="A base model's tokenizer: a run's base (runId), a catalogue model (baseModel), "
                      "or the server's default model")
    async def tokenizer(self, info: Info, run_id: strawberry.ID | None = None,
                        base_model: str | None = None) -> TokenizerInfo:
        user = await info.context.user()
        result = await info.context.services.runs.tokenizer(user, None if run_id is None else str(run_id), base_model)
        return TokenizerInfo.from_result(result)

    @strawberry.field(description="The GPU runtime's state: bases loaded, resident and evicted runs, queue depth "
                      "per user, rows and base forward passes per tick (admins only)")
    async def runtime(self, info: Info) -> JSON:
        user = await info.context.user()
        return JSON(await info.context.services.runs.runtime_state(user))

    @strawberry.field(description="The datums (token level) the server builds for a batch of items on a run's model")
    async def render_datums(self, info: Info, run_id: strawberry.ID, batch: list[BatchItem],
                            loss_fn: LossFn = DEFAULT_LOSS) -> list[Datum]:
        user = await info.context.user()
        result = await info.context.services.runs.render_datums(user, str(run_id), batch_items(batch),
                                                                loss_fn=loss_fn.value)
        return [Datum.from_dict(datum) for datum in result.datums]

    @strawberry.field
    async def api_keys(self, info: Info) -> list[ApiKey]:
        user = await info.context.user()
        return [ApiKey.from_row(row) for row in await info.context.services.keys.list(user)]

    @strawberry.field(description="Compute seconds, GPU-seconds, cost and tokens trained and sampled over the last "
                      "`days` days, in all, by day and by run, from each applied call's record; userId: another "
                      "user's (admins only)")
    async def usage(self, info: Info, days: int = DEFAULT_DAYS, user_id: strawberry.ID | None = None) -> UsageReport:
        user = await info.context.user()
        return UsageReport.of(await info.context.services.usage.report(user, None if user_id is None else str(user_id),
                                                                      days))
