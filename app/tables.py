"""SQLAlchemy tables. Portable types only, so the same Alembic migrations run on SQLite and PostgreSQL."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any, TypedDict

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from gpu_runtime.contract.checks import MAX_REQUEST_ID_LENGTH
from gpu_runtime.contract.json_types import JSONObject
from gpu_runtime.contract.training_settings import LoraSettings


def utcnow() -> datetime:
    return datetime.now(UTC)


ID_LENGTH = 36  # a dashed UUID


def new_id() -> str:
    # A dashed UUID (36 characters): the text form of Supabase's user ids, which RLS compares with auth.uid()::text.
    return str(uuid.uuid4())


# The largest integer a database column holds (SQLite's and PostgreSQL's BIGINT): a larger id is the caller's error.
MAX_INTEGER = 2**63 - 1


def row_number(value: str) -> int | None:
    """An integer row id as a caller sends it (decimal ASCII digits within BIGINT), else None: no row, never a query."""
    return int(value) if value.isascii() and value.isdigit() and int(value) <= MAX_INTEGER else None


def could_be_id(value: str) -> bool:
    # What a caller sends as an id: anything else is no row, never a query (PostgreSQL refuses NUL in a parameter).
    return 0 < len(value) <= ID_LENGTH and value.isprintable()


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC on every backend: SQLite drops the zone that PostgreSQL keeps."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        return value.astimezone(UTC) if value is not None and value.tzinfo else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class StoredText(TypeDecorator[str]):
    """Free text (model output, prompts, names) stored with NUL as U+FFFD on every backend: PostgreSQL's text
    cannot hold NUL, and a byte-level tokenizer can sample one (SmolLM2's token 190 decodes to it)."""

    impl: type[String] = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Any) -> str | None:
        return value.replace("\x00", "\ufffd") if value is not None else None


class StoredString(StoredText):
    impl = String  # the migrations' VARCHAR(n), unchanged
    cache_ok = True  # read from each class's own attributes, never inherited


class Base(DeclarativeBase):
    type_annotation_map = {list[Any]: JSON, datetime: UTCDateTime()}  # a dict column names JSON itself


EMAIL_LENGTH = 320  # an address's most: 64 local + @ + 255 domain
NAME_LENGTH = 200  # users' and API keys' display names
NEXT_PATH_LENGTH = 500  # where a sign-in returns to
RUN_NAME_LENGTH = 200  # a run's name (issue 18 §1's bounds)
RUN_TAGS_MOST = 20  # tags per run…
RUN_TAG_LENGTH = 40  # …of at most this many characters each
RUN_NOTE_LENGTH = 10_000  # a run's note

# 36 characters: every id is a dashed UUID; a Supabase user id is used as the Signal user id as it is.
USER_ID = String(ID_LENGTH)


class User(Base):
    __tablename__ = "users"
    id: Mapped[str] = mapped_column(USER_ID, primary_key=True, default=new_id)
    email: Mapped[str] = mapped_column(String(EMAIL_LENGTH), unique=True)
    name: Mapped[str] = mapped_column(StoredString(NAME_LENGTH), default="")
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # A disabled user signs in nowhere: no dashboard session, no API key (app/services/users.py).
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)


class ApiKey(Base):
    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True, default=new_id)
    user_id: Mapped[str] = mapped_column(USER_ID, ForeignKey("users.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(StoredString(NAME_LENGTH), default="")
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(default=None)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)


class Run(Base):
    __tablename__ = "runs"
    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True, default=new_id)
    user_id: Mapped[str] = mapped_column(USER_ID, ForeignKey("users.id", ondelete="CASCADE"), index=True)
    base_model: Mapped[str] = mapped_column(String(300))
    lora_config: Mapped[LoraSettings] = mapped_column(JSON)  # as the runtime resolved it: the targets named
    optimizer_config: Mapped[dict[str, float]] = mapped_column(JSON)  # AdamW's settings (contract adam_settings)
    seed: Mapped[int] = mapped_column(Integer, default=0)
    gpu_config: Mapped[str] = mapped_column(String(40), default="")  # the requested allocation, and the pool key's
    # What it trains on, as its runtime reported at createRun: "cpu", "cuda:0"; "" for runs older than the column.
    device: Mapped[str] = mapped_column(String(40), default="", server_default="")
    quantization: Mapped[str] = mapped_column(String(8), default="", server_default="")  # "" | "8bit" | "4bit"
    # What the database can know: "active", or "failed" once its runtime answered that it no longer has the run.
    # Resident or evicted is the runtime's to say (runtime_state), read live.
    status: Mapped[str] = mapped_column(String(20), default="active")
    # The owner's labels (issue 18 §1): a name (not unique; createRun gives one when none is asked for), tags and a note.
    name: Mapped[str] = mapped_column(StoredString(RUN_NAME_LENGTH), default="", server_default="")
    tags: Mapped[list[Any]] = mapped_column(JSON, default=list, server_default="[]")
    note: Mapped[str] = mapped_column(StoredText, default="", server_default="")
    # Archived (hidden from the default list, refused training and sampling) since; None: not archived. Beside
    # status, not one of its values: unarchiving gives back whatever status the run had.
    archived_at: Mapped[datetime | None] = mapped_column(default=None)
    step: Mapped[int] = mapped_column(Integer, default=0)
    trainable_params: Mapped[int] = mapped_column(BigInteger, default=0)
    total_params: Mapped[int] = mapped_column(BigInteger, default=0)
    # Device seconds its calls took (a co-batched pass shared by token share), in every mode; × its GPUs = GPU-seconds.
    compute_seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    call_seq: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")  # the last call's ticket (call_order.py)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Metric(Base):
    __tablename__ = "metrics"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(64))
    value: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Sample(Base):
    __tablename__ = "samples"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    prompt: Mapped[str] = mapped_column(StoredText)
    output: Mapped[str] = mapped_column(StoredText)
    params: Mapped[JSONObject] = mapped_column(JSON)  # the sample's settings, as SampleParams gave them
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class BaseSample(Base):
    """A sample of a base model alone (no run): the user's own history of them, as `samples` is a run's. Written when
    the call asks to store (a /v1 request unless it says `store: false`; `sample(baseModel, store: true)`)."""

    __tablename__ = "base_samples"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    base_model: Mapped[str] = mapped_column(String(300))
    prompt: Mapped[str] = mapped_column(StoredText)
    output: Mapped[str] = mapped_column(StoredText)
    params: Mapped[JSONObject] = mapped_column(JSON)  # the sample's settings, as SampleParams gave them
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    mode: Mapped[str] = mapped_column(String(20))
    path: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    hub_url: Mapped[str | None] = mapped_column(Text, default=None)  # where push_to_hub uploaded it, if it did
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Unique per run and mode (its kind: adapter, merged, state, sampler); a sampler snapshot and a state checkpoint
    # may share one ("final"). Saved before names existed: step-N.
    name: Mapped[str] = mapped_column(String(128), default="")
    expires_at: Mapped[datetime | None] = mapped_column(default=None)  # unnamed sampler snapshots only
    # What the runtime's SaveStateResult says of it: AdamW's state is in it (loadState resumes it exactly), and how
    # many forward_backward calls' pending gradients it left out. Rows saved before these existed read false and 0.
    with_optimizer: Mapped[bool] = mapped_column(Boolean, default=False)
    pending_excluded: Mapped[int] = mapped_column(Integer, default=0)
    # Published by its owner: any signed-in user may read it by its tinker:// path (sample it, see it listed), never
    # write it (docs/TINKER.md).
    public: Mapped[bool] = mapped_column(Boolean, default=False)

    __table_args__ = (Index("ix_checkpoints_run_mode_name", "run_id", "mode", "name", unique=True),)


class LoginLink(Base):
    """A one-time dashboard sign-in link: only its hash is stored; consuming it sets used_at."""

    __tablename__ = "login_links"
    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    user_id: Mapped[str] = mapped_column(USER_ID, ForeignKey("users.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime] = mapped_column()
    used_at: Mapped[datetime | None] = mapped_column(default=None)


USER_AGENT_LENGTH = 300  # a browser's User-Agent, cut to this: it only names the device on the Account page


class DashboardSession(Base):
    """One signed-in dashboard browser: the cookie holds a random id, this row its hash (app/services/sessions.py).
    A cookie without a live row (unknown, revoked or expired) is signed out."""

    __tablename__ = "sessions"
    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    user_id: Mapped[str] = mapped_column(USER_ID, ForeignKey("users.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen_at: Mapped[datetime] = mapped_column(default=utcnow)  # written at most once a minute
    expires_at: Mapped[datetime] = mapped_column()
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)
    user_agent: Mapped[str] = mapped_column(StoredString(USER_AGENT_LENGTH), default="")


class RunSession(Base):
    """A caller's numbered session on a run (app/services/call_order.py): the last number that holds a ticket, so a
    pipelined call's successor, on any server process, takes its ticket after it."""

    __tablename__ = "run_sessions"
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    session: Mapped[str] = mapped_column(String(64), primary_key=True)
    last_seq: Mapped[int] = mapped_column(BigInteger)
    ticket: Mapped[int] = mapped_column(BigInteger)  # the run's ticket of that last call: old sessions are forgotten
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class Pane(TypedDict):
    """One playground pane as PlaygroundStream.panes keeps it (web/playground_stream.py writes it)."""

    model: str  # the picker's value
    label: str
    run_id: str | None  # None: a base model alone
    snapshot: str | None
    base_model: str | None
    params: dict[str, Any]  # SampleParams' fields as dataclasses.asdict gave them: SampleParams(**params) again
    request_id: str  # the runtime request id a Cancel names


class PlaygroundStream(Base):
    """A playground sample validated by its POST and waiting for its stream's GET (EventSource is GET-only), keyed by
    the hash of its one-time id: any server process may answer the GET, which opens it once (app/services/
    playground_streams.py). `panes` holds each pane's model and sample, and the runtime request id a Cancel names."""

    __tablename__ = "playground_streams"
    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    user_id: Mapped[str] = mapped_column(USER_ID, ForeignKey("users.id", ondelete="CASCADE"), index=True)
    panes: Mapped[list[Pane]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime] = mapped_column()  # not opened by then: refused, and dropped by a later POST
    opened_at: Mapped[datetime | None] = mapped_column(default=None)  # set once, by the one GET that streams it


class LoginAttempt(Base):
    """One "Sign in with Google" in flight, keyed by its state: the PKCE verifier lives here, not in a cookie,
    so overlapping logins and several server processes each find their own."""

    __tablename__ = "login_attempts"
    state: Mapped[str] = mapped_column(String(64), primary_key=True)
    code_verifier: Mapped[str] = mapped_column(String(200))
    next_path: Mapped[str] = mapped_column(String(NEXT_PATH_LENGTH), default="/")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime] = mapped_column()
    used_at: Mapped[datetime | None] = mapped_column(default=None)


class BillingOutbox(Base):
    """One deduction owed to the billing service (docs/BILLING.md), keyed by the call's idempotency key: written
    when the call's result is recorded, sent after it (and at start, and every SIGNAL_BILLING_RETRY_S), kept once
    sent (`sent_at`) so a retry of the call is never charged twice. No foreign key: deleting a run keeps what it owes."""

    __tablename__ = "billing_outbox"
    idempotency_key: Mapped[str] = mapped_column(String(200), primary_key=True)
    user_id: Mapped[str] = mapped_column(USER_ID, index=True)
    run_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    operation: Mapped[str] = mapped_column(String(32))
    compute_seconds: Mapped[float] = mapped_column(Float)
    device: Mapped[str] = mapped_column(String(40), default="", server_default="")  # the run's; "": before 0008
    gpu_type: Mapped[str] = mapped_column(String(40))
    gpu_count: Mapped[int] = mapped_column(Integer)
    gpu_seconds: Mapped[float] = mapped_column(Float)
    credits: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    sent_at: Mapped[datetime | None] = mapped_column(default=None, index=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str] = mapped_column(StoredText, default="")


# ---- Tinker's wire (/api/v1, app/tinker; docs/TINKER.md) ---------------------------------------------------

TINKER_ID_LENGTH = 160  # `{session}:train:{n}` / `{session}:sample:{n}`: longer than a run id, so mapped to one


class TinkerSession(Base):
    """A Tinker ServiceClient's session: created once per client, heartbeated, finished (then 410)."""

    __tablename__ = "tinker_sessions"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    user_id: Mapped[str] = mapped_column(USER_ID, ForeignKey("users.id", ondelete="CASCADE"), index=True)
    display_name: Mapped[str] = mapped_column(StoredString(NAME_LENGTH), default="")
    user_metadata: Mapped[JSONObject] = mapped_column(JSON, default=dict)  # the Tinker client's, as it sent it
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)


class TinkerModel(Base):
    """A Tinker model id (kind "train") or sampling session id (kind "sample") and the Signal run behind it."""

    __tablename__ = "tinker_models"
    id: Mapped[str] = mapped_column(String(TINKER_ID_LENGTH), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(64), index=True)
    user_id: Mapped[str] = mapped_column(USER_ID, ForeignKey("users.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(8))
    run_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), default=None, index=True)
    base_model: Mapped[str] = mapped_column(String(300))  # the name the client used (get_info's model_name)
    model_path: Mapped[str | None] = mapped_column(Text, default=None)  # a sampler's tinker:// path, if any
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class TinkerFuture(Base):
    """One submitted Tinker operation: inserted before it is dispatched, its result stored once encoded.

    Unique on (key_kind, key_scope, key_seq): "train" (model_id, seq_id) for training operations, "model"
    (session_id, model_seq_id) for create_model and create-via-load, "sampler" (session_id,
    sampling_session_seq_id) for create_sampling_session, "sample" (sampling_session_id, seq_id) for asample. A
    resubmission finds the row and gets its request_id; nothing is dispatched twice."""

    __tablename__ = "tinker_futures"
    request_id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True, default=new_id)
    user_id: Mapped[str] = mapped_column(USER_ID, ForeignKey("users.id", ondelete="CASCADE"), index=True)
    key_kind: Mapped[str] = mapped_column(String(8))
    key_scope: Mapped[str] = mapped_column(String(TINKER_ID_LENGTH))
    key_seq: Mapped[int] = mapped_column(BigInteger)
    request_type: Mapped[str] = mapped_column(String(40))  # the SDK's X-Tinker-Request-Type names: ForwardBackward
    state: Mapped[str] = mapped_column(String(10), default="pending", index=True)  # pending | done | failed
    media_type: Mapped[str] = mapped_column(String(40), default="")  # the stored result's: protobuf or JSON
    result: Mapped[bytes | None] = mapped_column(LargeBinary, default=None)
    sample_sequence_ids: Mapped[list[Any]] = mapped_column(JSON, default=list)
    owner: Mapped[str] = mapped_column(String(64), default="")  # the process that runs it
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)  # its owner's last sign of life
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)

    __table_args__ = (Index("ix_tinker_futures_key", "key_kind", "key_scope", "key_seq", unique=True),)


class CallRecord(Base):
    """One applied call, recorded once (issue 19 §5): written in the same transaction as everything the call records
    (its metric rows, `runs.step`, its samples, `runs.compute_seconds`, the billing outbox row), so a retry finds
    this row and writes nothing, and a call whose answer was lost is recorded whole by its retry.

    Keyed like the billing outbox: `{run_id}:{request_id}`, or `user:{user_id}:{request_id}` for a call on a base
    model alone (no run). No foreign key: a user's usage outlives a deleted run. The usage view reads these rows."""

    __tablename__ = "call_records"
    key: Mapped[str] = mapped_column(String(200), primary_key=True)
    user_id: Mapped[str] = mapped_column(USER_ID, index=True)
    run_id: Mapped[str | None] = mapped_column(String(ID_LENGTH), default=None, index=True)  # None: a base model alone
    request_id: Mapped[str] = mapped_column(String(MAX_REQUEST_ID_LENGTH))
    operation: Mapped[str] = mapped_column(String(32))
    base_model: Mapped[str] = mapped_column(String(300), default="")
    compute_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    device: Mapped[str] = mapped_column(String(40), default="")
    gpu_type: Mapped[str] = mapped_column(String(40), default="")  # "cpu" on the CPU
    gpu_count: Mapped[int] = mapped_column(Integer, default=0)  # 0 on the CPU
    gpu_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    credits: Mapped[float] = mapped_column(Float, default=0.0)  # at the rates when it was recorded
    tokens_in: Mapped[int] = mapped_column(BigInteger, default=0)  # trained (forward_backward), or prompt (sample)
    tokens_out: Mapped[int] = mapped_column(BigInteger, default=0)  # generated (sample)
    tokens_cached: Mapped[int] = mapped_column(BigInteger, default=0)  # of a sample's prompt tokens, found in the cache
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)


class StoredResponse(Base):
    """One answered /v1/responses request, kept for `previous_response_id` (app/services/stored_responses.py): in the
    database so that a restart keeps it and every server process reads it. Its user's alone; deleted with its run
    (`run_id`; None for a base model alone), at `expires_at`, or as the user's oldest past the per-user bound."""

    __tablename__ = "openai_responses"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # resp_ + 32 hex digits
    user_id: Mapped[str] = mapped_column(USER_ID, ForeignKey("users.id", ondelete="CASCADE"), index=True)
    run_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), default=None, index=True)
    messages: Mapped[list[Any]] = mapped_column(JSON)  # the conversation, its answer (and its token ids) included
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime] = mapped_column()
