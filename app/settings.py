"""Server settings, read from `SIGNAL_*` environment variables and `.env`.

Passed explicitly to `create_app(settings)`; nothing reads the environment at import time.
Every field here is documented in `.env.example` and the README (a test checks both).
"""

from __future__ import annotations

import os
import sys
from dataclasses import fields
from pathlib import Path

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.resources import resource_dir
from gpu_runtime.contract import RuntimeOptions

DB_LOCK_TIMEOUT_S = 5.0  # a write waits this long for a lock (SQLite's busy timeout, PostgreSQL's lock_timeout)
DB_STATEMENT_TIMEOUT_S = 30.0  # PostgreSQL's statement_timeout: a stuck statement becomes UNAVAILABLE, not a hang
RECORD_RETRY_S = 10.0  # an applied call's recording is retried this long, then the call answers UNAVAILABLE
SDK_TIMEOUT_S = 600.0  # the SDK's HTTP timeout (rewardsignal.transport.DEFAULT_TIMEOUT): every deadline ends before it
# Each method's deadline in seconds, from its arrival, queue time included (issue 19 §3); past it, the call still not
# applied is withdrawn and answers DEADLINE_EXCEEDED. create_run's and save_state's cover a model load, a Hub upload.
DEADLINES_S: dict[str, float] = {
    "create_run": 540.0, "forward_backward": 300.0, "forward": 300.0, "optim_step": 120.0, "sample": 300.0,
    "save_state": 540.0, "load_state": 300.0, "save_weights_for_sampler": 300.0,
}


# SIGNAL_MAX_USER_SAMPLES_IN_FLIGHT's default: above the cookbook's rl_loop, which keeps 128 asample futures in flight.
MAX_USER_SAMPLES_IN_FLIGHT = 128

class Settings(BaseSettings):
    # populate_by_name: tests and callers pass `supabase_url=...` even where the env name is an alias.
    model_config = SettingsConfigDict(env_prefix="SIGNAL_", env_file=".env", extra="ignore", populate_by_name=True)

    data_dir: Path = Field(Path("./data"), description="Runs, checkpoints, model cache and the SQLite file.")
    database_url: str = Field("", description="SQLAlchemy async URL; empty means sqlite in the data dir.")
    db_lock_timeout_s: float = Field(DB_LOCK_TIMEOUT_S, gt=0, description="A write waits this long for a database "
                                     "lock (SQLite's busy timeout, PostgreSQL's lock_timeout), then answers UNAVAILABLE.")
    db_statement_timeout_s: float = Field(DB_STATEMENT_TIMEOUT_S, gt=0, description="PostgreSQL's statement_timeout: "
                                          "a statement running longer answers UNAVAILABLE.")
    record_retry_s: float = Field(RECORD_RETRY_S, gt=0, description="An applied call's recording (its call record, "
                                  "metrics, step, samples, compute seconds) is retried this long while the database "
                                  "cannot take it, then the call answers UNAVAILABLE; its retry records it.")
    deadlines_s: dict[str, float] = Field(default_factory=lambda: dict(DEADLINES_S), description="Each method's "
                                          "deadline in seconds from arrival, queue time included, as JSON; the "
                                          "methods given replace their defaults (docs/ERRORS.md lists them). A call "
                                          "not applied by then is withdrawn and answers DEADLINE_EXCEEDED.")
    host: str = Field("127.0.0.1", description="Address `signal serve` binds.")
    port: int = Field(8000, description="Port `signal serve` binds.")
    public_url: str = Field("", description="URL printed for users; empty means http://host:port.")
    backend: str = Field("local", description="GPU runtime: `local` (a worker process on this machine) or `modal` "
                         "(a warm Modal container per pool; needs Modal credentials and `modal deploy -m gpu_runtime.modal_app`).")
    device: str = Field("auto", description="Worker device: auto, cpu, cuda, cuda:N.")
    threads: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1, description="CPU threads of the local "
                         "runtime's torch (torch.set_num_threads); default: this machine's cores. On a machine "
                         "others share, 1: more threads than free cores makes CPU training many times slower.")
    models_file: Path = Field(resource_dir("config") / "models.yaml", description="The model catalogue.")
    sdk_dir: Path = Field(Path(sys.prefix) / "share" / "signal" / "sdk", description="Where `make install` builds "
                          "the SDK's wheel; the server serves it at /sdk/ and Getting started prints its URL.")
    default_model: str = Field("HuggingFaceTB/SmolLM2-135M-Instruct", description="Base model when none is given.")
    max_request_bytes: int = Field(16 * 1024 * 1024, description="Largest request body; bigger ones get 413.")
    openai_responses_ttl_s: float = Field(3600.0, gt=0, description="How long /v1/responses keeps a response for "
                                                                     "previous_response_id (in the database, per user).")
    max_primitives_per_request: int = Field(4, ge=1, description="Most primitive calls (forwardBackward, optimStep, "
                                            "sample, ...) one GraphQL request may carry; more is BAD_INPUT naming "
                                            "the first field past it, before any runs.")
    # ---- the GPU runtime's own settings: defaults from RuntimeOptions, their single source ----
    tinker_poll_s: float = Field(30.0, gt=0, le=40, description="Tinker's retrieve_future holds a pending poll this "
                                 "long, then answers try_again (the SDK times a poll out at 45 s).")
    tinker_result_ttl_s: float = Field(3600.0, gt=0, description="A finished Tinker future stays retrievable this "
                                       "long; then its row is deleted (and a resubmission of it runs again).")
    tinker_session_lapse_s: float = Field(120.0, gt=0, description="A Tinker session whose heartbeats (the SDK "
                                          "sends one every 10 s) stop this long has ended, as a closed one has: its "
                                          "pending futures fail and their samples are withdrawn; tests shorten it.")
    tinker_min_checkpoint_ttl_s: int = Field(3600, ge=1, description="The shortest ttl_seconds a Tinker save takes "
                                             "(Tinker's own bound, an hour); tests shorten it.")
    tinker_tokenizer_dir: bool = Field(True, description="Local backend only: Tinker's get_info answers a "
                                       "directory the runtime wrote the base's tokenizer to (save_pretrained) as "
                                       "tokenizer_id, so TrainingClient.get_tokenizer() works offline on this "
                                       "machine; false where Tinker clients run elsewhere (the catalogue's tokenizer).")
    max_batch_size: int = Field(RuntimeOptions.max_batch_size, description="Most items one forward_backward may carry.")
    # Per-call sizes: the server refuses an over-bound call before it leaves, the runtime again once it has tokenized.
    max_batch_tokens: int = Field(RuntimeOptions.max_batch_tokens, description="Most tokens one forward_backward "
                                  "(or forward) may carry, its rows summed.")
    max_sample_rows: int = Field(RuntimeOptions.max_sample_rows, description="Most sequences one sample call makes: "
                                 "prompts x numSamples.")
    max_sample_prompt_tokens: int = Field(RuntimeOptions.max_sample_prompt_tokens, description="Most prompt tokens "
                                          "one sample call prefills: their sum x numSamples.")
    max_sample_tokens: int = Field(RuntimeOptions.max_sample_tokens, description="Most tokens one sample call may "
                                   "generate: prompts x numSamples x maxTokens.")
    tick_tokens: int = Field(RuntimeOptions.tick_tokens,
                             description="Most tokens of forward_backward rows in one co-batched pass.")
    decode_chunk_seconds: float = Field(RuntimeOptions.decode_chunk_seconds,
                                        description="A sampling group yields to other calls after this long.")
    resident_bytes: int = Field(RuntimeOptions.resident_bytes,
                                description="Memory for resident runs' LoRA, AdamW and gradients; LRU idle runs are "
                                "evicted past it. 0: sized each tick from the GPU's free memory, a pass's activations "
                                "at the token budget set aside (2 GiB on a CPU).")
    resident_runs: int = Field(RuntimeOptions.resident_runs, description="Most runs held in memory at once.")
    snapshot_every_steps: int = Field(RuntimeOptions.snapshot_every_steps,
                                      description="A changed run is snapshotted every N optim_steps…")
    snapshot_every_seconds: float = Field(RuntimeOptions.snapshot_every_seconds,
                                          description="…or after this many seconds, whichever comes first.")
    keep_snapshots: int = Field(RuntimeOptions.keep_snapshots, description="Snapshots kept per run, newest first.")
    base_idle_seconds: float = Field(RuntimeOptions.base_idle_seconds,
                                     description="A base model with no resident runs is unloaded after this long idle.")
    local_ranks: int = Field(RuntimeOptions.local_ranks, description="Rank processes of the local runtime: N > 1 "
                             "shards each base with FSDP across N CUDA GPUs, or N CPU processes over gloo.")
    rank_timeout_seconds: float = Field(RuntimeOptions.rank_timeout_seconds, description="A multi-rank collective "
                                        "that waits longer means a hung rank: every rank stops, the call fails "
                                        "WORKER_FAILED and the pool restarts.")
    unnamed_snapshot_seconds: float = Field(RuntimeOptions.unnamed_snapshot_seconds, description="An unnamed "
                                            "sampler snapshot (saveWeightsForSampler without a name) expires this "
                                            "long after it was made (docs/SNAPSHOTS.md).")
    min_free_disk_bytes: int = Field(RuntimeOptions.min_free_disk_bytes, description="Below this free space in the "
                                     "data directory, the runtime refuses calls that write (forward_backward, "
                                     "optim_step, save_state, create_run) with RESOURCE_EXHAUSTED; sampling goes on.")
    max_user_calls_in_flight: int = Field(RuntimeOptions.max_user_calls_in_flight, description="Most calls of one "
                                          "user the runtime works on at once (every server process's calls count).")
    max_user_calls_waiting: int = Field(RuntimeOptions.max_user_calls_waiting, description="Past the calls in "
                                        "flight, most calls of one user waiting their turn; more are refused "
                                        "RESOURCE_EXHAUSTED (resource calls, retryAfterS; HTTP 429 on /v1).")
    max_user_samples_in_flight: int = Field(MAX_USER_SAMPLES_IN_FLIGHT, ge=1, le=100_000, description="Most sample calls of one user "
                                            "this server process has in flight, whichever wire sent them (GraphQL, "
                                            "/v1, Tinker's asample, the playground); past it a sample is refused at "
                                            "once RESOURCE_EXHAUSTED (resource calls, retryAfterS): HTTP 429 with "
                                            "Retry-After on /v1 and on Tinker's asample, whose SDK retries it "
                                            "(app/services/sample_shares.py).")
    export_limit_bytes: int = Field(RuntimeOptions.export_limit_bytes, description="Most bytes of a checkpoint "
                                    "downloaded through the runtime when the server cannot read its files (Modal's "
                                    "Volume); a bigger one is copied with `signal pull`, as the run page says.")
    allow_downloads: bool = Field(False, description="Let the worker download models from the HF Hub.")
    worker_log: Path | None = Field(None, description="File for the worker's stderr; empty means inherit.")
    bootstrap_admin: bool = Field(True, description="On first start with no users, create an admin and print a key.")
    log_level: str = Field("info", description="Server log level.")
    # ---- dashboard and sign-in ----
    session_secret: str = Field("", description="Signs the dashboard's session cookie; empty: generated once "
                                "into the data dir (mode 0600).")
    session_ttl_s: int = Field(14 * 24 * 3600, gt=0, description="A dashboard session ends after this long without "
                               "a visit, in seconds (its row in `sessions`; the cookie lasts as long).")
    session_recheck_s: float = Field(15.0, gt=0, le=15, description="An open dashboard event stream checks its "
                                     "session this often and ends with `signed-out` once it is revoked or expired; "
                                     "a GraphQL subscription checks its key (or session) as often and ends with "
                                     "UNAUTHENTICATED; so does an open /v1 stream (an error event) and Tinker's "
                                     "pending futures (failed, category user).")
    live_poll_s: float = Field(2.0, gt=0, le=3600, description="A run page's event stream reads new rows this often "
                               "(and sends a keep-alive): rows another server process wrote; this process's "
                               "arrive at once.")
    login_link_ttl_s: int = Field(900, description="How long a one-time login link stays valid, in seconds.")
    admin_emails: str = Field("", description="Comma-separated emails made admins when they sign in.")
    # The seed's names (SUPABASE_*) and SIGNAL_-prefixed aliases are both accepted; the prefixed one wins.
    supabase_url: str = Field("", validation_alias=AliasChoices("SIGNAL_SUPABASE_URL", "SUPABASE_URL"),
                              description="Supabase project URL; with the anon key, enables Google sign-in.")
    supabase_anon_key: str = Field("", validation_alias=AliasChoices("SIGNAL_SUPABASE_ANON_KEY", "SUPABASE_ANON_KEY"),
                                   description="Supabase anon (public) key.")
    supabase_jwt_secret: str = Field("", validation_alias=AliasChoices("SIGNAL_SUPABASE_JWT_SECRET",
                                                                       "SUPABASE_JWT_SECRET"),
                                     description="Legacy HS256 JWT secret; empty: only JWKS (ES256/RS256) keys.")
    # ---- billing hooks (docs/BILLING.md); the seed's name FRONTIER_BACKEND_URL works too ----
    frontier_backend_url: str = Field("", validation_alias=AliasChoices("SIGNAL_FRONTIER_BACKEND_URL",
                                                                        "FRONTIER_BACKEND_URL"),
                                      description="Billing backend's base URL; empty: no credit checks, no "
                                      "integrations, no deductions.")
    billing_secret: str = Field("", description="Shared secret sent as `Authorization: Bearer …` on every billing call.")
    billing_timeout_s: float = Field(5.0, gt=0, description="Timeout of each billing call, in seconds.")
    # ---- the runtime's heartbeat (/healthz) ----
    heartbeat_interval_s: float = Field(2.0, gt=0, description="The server asks the local runtime for a heartbeat "
                                        "this often (its reader thread answers, never the tick).")
    busy_tick_s: float = Field(60.0, gt=0, description="/healthz says `busy` (200) while one tick runs longer.")
    unresponsive_s: float = Field(10.0, gt=0, description="/healthz says `unresponsive` (503) after this long "
                                  "without a heartbeat.")
    restart_after_s: float = Field(120.0, gt=0, description="A runtime this server started that has not answered a "
                                   "heartbeat for this long is killed; the next call starts another (a runtime "
                                   "started by `signal runtime` is reported, never killed).")
    billing_retry_s: float = Field(30.0, gt=0, description="Deductions the backend did not take are sent again "
                                   "this often (and after every call, and at start).")
    gpu_second_rate: float = Field(1.0, ge=0, description="Credits per GPU-second: a run's cost, and each "
                                   "deduction's `credits`.")
    cpu_second_rate: float = Field(0.0, ge=0, description="Credits per compute second of a run on the CPU "
                                   "(device `cpu`), in place of the GPU rate.")

    @field_validator("deadlines_s")
    @classmethod
    def _deadlines(cls, value: dict[str, float]) -> dict[str, float]:
        """The methods given over the defaults; each a known method, and over before the SDK gives up."""
        unknown = sorted(set(value) - set(DEADLINES_S))
        if unknown:
            raise ValueError(f"no deadline for {unknown[0]!r}: the methods are {', '.join(DEADLINES_S)}")
        bad = [name for name, seconds in value.items() if not 0 < seconds < SDK_TIMEOUT_S]
        if bad:
            raise ValueError(f"the deadline of {bad[0]} must be over 0 and under the SDK's {SDK_TIMEOUT_S:.0f} s")
        return DEADLINES_S | value

    @field_validator("worker_log", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else value

    def runtime_options(self) -> RuntimeOptions:
        """The runtime's settings, as the runtime takes them (it checks them again)."""
        return RuntimeOptions(**{f.name: getattr(self, f.name) for f in fields(RuntimeOptions)})

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{(self.data_dir / 'signal.db').resolve()}"

    @property
    def resolved_public_url(self) -> str:
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")

    @property
    def billing_enabled(self) -> bool:
        return bool(self.frontier_backend_url.strip())

    @property
    def supabase_enabled(self) -> bool:
        return bool(self.supabase_url and self.supabase_anon_key)

    @property
    def admin_email_set(self) -> frozenset[str]:
        return frozenset(e.strip().lower() for e in self.admin_emails.split(",") if e.strip())
