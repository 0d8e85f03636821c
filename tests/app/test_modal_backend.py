"""The Modal backend (issue 8 §3), offline.

Modal's cloud cannot be reached from here, so the only stand-in is Modal's own offline path: `.local()` on the
app module's class runs `@modal.enter` and the methods in this process, without credentials or a Volume (a
commit there only records what it covered). `ModalBackend` is pointed at that path through its constructor
(`lookup=`, `local=True`); everything else is the production code: the pool keys, `with_options(gpu=...)`, one
cached instance per pool, every argument and answer through JSON, and the container's engine thread. The
"container" gets a data directory of its own, apart from the server's. What a real deploy adds (images,
Volumes, GPUs, `.remote.aio`) is not exercised here.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import modal
import pytest

from app.backends.modal import ModalBackend, pool_gpu
from app.catalog import Catalog
from app.settings import Settings
from gpu_runtime import modal_app
from gpu_runtime.client.allocation import GPUS, PoolKey, parse_gpu_config, pool_key
from gpu_runtime.client.modal_names import HF_SECRET_NAME
from gpu_runtime.contract import CONTRACT_VERSION, OptimStep, RunInfo, RuntimeState
from gpu_runtime.engine.journal import Journal
from gpu_runtime.errors import FailedPrecondition, WorkerFailed
from rewardsignal import BadInputError, SignalClient
from tests.helpers.live_server import TINY_MODEL, LiveServer, settings_for
from tests.web.conftest import api_key_for, sign_in

# `.local()` warns that the Volume is not mounted: that is the point of the offline path.
pytestmark = pytest.mark.filterwarnings("ignore:The .* function is executing locally:UserWarning")

REPO = Path(__file__).resolve().parents[2]
BATCH = [{"input": "The quick brown fox", "output": " jumps over the lazy dog."},
         {"text": "Machine learning is transforming technology."}]
TINY_POOL = pool_key(TINY_MODEL, "L40S:1", None)
# The runtime's export limit here: the tiny model's state checkpoints (tens of KB) download through the runtime, its
# merged ones (its 3M-parameter embedding in float32, over 12 MB) are past it, as a real model's merged ones are.
EXPORT_LIMIT = 1024**2


@pytest.fixture(scope="module")
def container_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The offline container's data directory (its Volume), apart from every server's."""
    path = tmp_path_factory.mktemp("modal-volume")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(modal_app.DATA_DIR_ENV, str(path))
        patch.setenv(modal_app.DEVICE_ENV, "cpu")
        patch.setenv(modal_app.DOWNLOADS_ENV, "0")  # the Hub cannot be reached from here: fail fast, as a worker does
        yield path


def offline_backend(settings: Settings) -> ModalBackend:
    return ModalBackend(settings, lookup=lambda: modal_app.Pool, local=True)


@pytest.fixture(scope="module")
def modal_server(tiny_model_dir: str, container_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    settings = settings_for(tmp_path_factory.mktemp("modal-server"), tiny_model_dir, backend="modal",
                            export_limit_bytes=EXPORT_LIMIT)
    server = LiveServer.start(settings, backend=offline_backend(settings))
    yield server
    server.stop()


# ---- the app module -------------------------------------------------------------------------------


def test_class_is_declared_one_container_per_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Modal keeps max_containers, retries and concurrency in closures, not on the built object: record what the
    module hands Modal's decorators (a fresh copy of it), then check what the built object does expose."""
    declared: dict[str, Any] = {}
    real_cls, real_concurrent = modal.App.cls, modal.concurrent

    def cls(self: modal.App, **options: Any) -> Any:
        declared["cls"] = options
        return real_cls(self, **options)

    def concurrent(**options: Any) -> Any:
        declared["concurrent"] = options
        return real_concurrent(**options)

    monkeypatch.setattr(modal.App, "cls", cls)
    monkeypatch.setattr(modal, "concurrent", concurrent)
    spec = importlib.util.spec_from_file_location("modal_app_probe", REPO / "gpu_runtime" / "modal_app.py")
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))

    options = declared["cls"]
    assert options["max_containers"] == 1 and options["retries"] == 0
    assert options["scaledown_window"] == modal_app.SCALEDOWN_WINDOW_S > 0
    assert options["startup_timeout"] >= 15 * 60  # a first start downloads the weights
    assert "gpu" not in options  # each pool's GPU comes from with_options
    assert declared["concurrent"]["max_inputs"] == modal_app.MAX_CONCURRENT_INPUTS > 1

    from modal._utils.async_utils import synchronizer

    built = synchronizer._translate_in(modal_app.Pool)
    assert set(built._method_partials) == {"call", "delete_run"}
    function_spec = built._class_service_function._spec
    assert list(function_spec.volumes) == ["/data"] == [modal_app.VOLUME_PATH]
    assert [s.name for s in map(synchronizer._translate_out, function_spec.secrets)] == [HF_SECRET_NAME]


def test_image_pins_what_the_tests_run() -> None:
    pins = dict(p.split("==") for p in modal_app.IMAGE_PACKAGES)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for name, version in (d.split("==") for d in project if "==" in d):
        if name in pins:
            assert pins[name] == version, name
    for name, version in pins.items():
        assert importlib.metadata.version(name).split("+")[0] == version, name
    assert "torch" in pins and "transformers" in pins and "peft" in pins


def test_server_side_modules_stay_light() -> None:
    code = ("import sys\nimport app.backends.modal, gpu_runtime.modal_app\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'peft', 'gpu_runtime.engine.engine', 'starlette', 'strawberry')"
            " if m in sys.modules)\nassert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_each_catalogue_entry_gets_its_gpu_string() -> None:
    """The pool key is canonical, and Modal parses the GPU string the backend applies into the same GPU."""
    from modal._utils.async_utils import synchronizer

    backend = offline_backend(Settings(_env_file=None))
    catalog = Catalog.from_file(Settings(_env_file=None).models_file)
    overrides = ["A10G", "a100-80gb", "H100:1", "h200", "B200", "L4", "T4:2"]
    for model in catalog.list():
        for gpu in [model.gpu, *overrides]:
            allocation = parse_gpu_config(gpu)
            key = pool_key(model.name, gpu, None)
            assert key == pool_key(model.name, str(allocation), "none")  # one spelling, one Modal variant
            expected = allocation.gpu_type if allocation.count == 1 else f"{allocation.gpu_type}:{allocation.count}"
            assert pool_gpu(key) == expected
            resources = synchronizer._translate_in(backend.instance(key))._options.resources.gpu_config
            assert (resources.gpu_type, resources.count) == (allocation.gpu_type, allocation.count)
            assert backend.instance(key) is backend.instance(key)  # one instance per pool
    assert pool_gpu(pool_key("m", "A10G", None)) == "A10"  # the README's name, Modal's spelling
    assert {gpu.name for gpu in GPUS} >= {"H200", "B200", "L4"}


# ---- the class through .local() -------------------------------------------------------------------


def test_class_runs_the_engine_and_answers_plain_data(tiny_model_dir: str, container_dir: Path) -> None:
    pool = modal_app.Pool.with_options(gpu="L40S")(  # type: ignore[attr-defined]  # app.cls makes a modal.Cls, typed as the class
        pool=pool_key("direct", "L40S", None), options="{}")
    created = pool.call.local("create_run", {"run_id": "direct1", "user_id": "u1", "base_model": tiny_model_dir,
                                             "lora": {"r": 4}, "seed": 1})
    assert created["result"]["trainable_params"] > 0
    assert Path(created["result"]["path"]).is_relative_to(container_dir)
    commits = pool.commits
    after_create = commits.count
    assert after_create >= 1  # create_run wrote config.json: committed before it answered
    fb = pool.call.local("forward_backward", {"run_id": "direct1", "batch": BATCH})
    assert fb["result"]["num_examples"] == 2 and commits.journals["direct1"] == 1
    bad = pool.call.local("forward_backward", {"run_id": "direct1", "batch": [{"nope": 1}]})
    assert bad["error"]["code"] == "BAD_INPUT" and bad["error"]["field"].startswith("batch[0]")
    missing = pool.call.local("optim_step", {"run_id": "no-such-run"})
    assert missing["error"]["code"] == "NOT_FOUND" and missing["error"]["field"] == "run_id"
    assert pool.call.local("optim_step", {"run_id": "direct1"})["result"]["step"] == 1
    assert commits.journals["direct1"] == 2
    root = container_dir / "runs" / "u1" / "direct1"
    assert root.is_dir()
    deleted = pool.delete_run.local("direct1")
    assert deleted["result"] == {"run_id": "direct1", "deleted": True}
    assert not root.exists() and commits.count > after_create + 2  # the deletion was committed too
    assert pool.delete_run.local("direct1")["error"]["code"] == "NOT_FOUND"


# ---- a live server on the Modal backend ------------------------------------------------------------


def train(server: LiveServer, key: str) -> dict[str, Any]:
    run = SignalClient(api_key=key, base_url=server.url).create_run(lora_r=8, seed=7)
    losses, norms = [], []
    for _ in range(3):
        losses.append(run.forward_backward(batch=BATCH).loss)
        norms.append(run.optim_step(learning_rate=0.01).grad_norm)
    outputs = run.sample(prompts=["The quick", "Machine"], max_tokens=5, temperature=0).outputs
    artifact = run.save_state(mode="adapter")
    return {"run": run, "losses": losses, "norms": norms, "outputs": outputs, "artifact": artifact}


def test_sdk_trains_on_modal_as_on_the_local_backend(modal_server: LiveServer, live_server: LiveServer,
                                                     container_dir: Path) -> None:
    on_modal = train(modal_server, modal_server.new_user())
    on_local = train(live_server, live_server.new_user())
    assert on_modal["losses"] == pytest.approx(on_local["losses"], rel=1e-6)
    assert on_modal["norms"] == pytest.approx(on_local["norms"], rel=1e-6)
    assert on_modal["losses"][-1] < on_modal["losses"][0]
    assert on_modal["outputs"] == on_local["outputs"]
    artifact = on_modal["artifact"]
    assert artifact.step == 3 and artifact.mode == "adapter" and artifact.size_bytes > 0
    # The files are the container's (its Volume), never the server's own disk.
    assert Path(artifact.checkpoint_path).is_relative_to(container_dir)
    assert not Path(artifact.checkpoint_path).is_relative_to(modal_server.settings.data_dir.resolve())
    assert on_modal["run"].refresh().info.gpu_config == "L40S:1"

    # Every acknowledged record was committed before its answer: the commit covering it came first.
    run_id = on_modal["run"].id
    commits = modal_server.backend.instance(TINY_POOL).commits
    acknowledged = [(method, committed) for run, method, committed in commits.acknowledged if run == run_id]
    assert [method for method, _ in acknowledged] == ["forward_backward", "optim_step"] * 3
    assert all(committed >= n for n, (_, committed) in enumerate(acknowledged, start=1)), acknowledged
    (root,) = container_dir.glob(f"runs/*/{run_id}")
    journal = Journal(root / "journal")
    held = journal.read()  # records before the oldest kept snapshot went with compaction (journal.py): counted by seq
    assert journal.first_seq + len(held) == commits.journals[run_id] == 6


def test_a_gpu_count_no_pool_can_have_is_refused_naming_the_legal_ones(modal_server: LiveServer) -> None:
    client = SignalClient(api_key=modal_server.new_user(), base_url=modal_server.url)
    with pytest.raises(BadInputError) as refused:
        client.create_run(lora_r=4, gpu_config="L40S:3")
    assert refused.value.code == "BAD_INPUT" and refused.value.field == "gpuConfig"
    assert "a pool has 1, 2, 4 or 8 GPUs, not 3; on L40S it fits with 1, 2, 4 or 8 GPUs" in str(refused.value)
    assert client.create_run(lora_r=4, gpu_config="H100").info.gpu_config == "H100:1"


def test_deleting_a_run_removes_its_files_from_the_volume(modal_server: LiveServer, container_dir: Path) -> None:
    client = SignalClient(api_key=modal_server.new_user(), base_url=modal_server.url)
    run = client.create_run(lora_r=4, seed=2)
    run.forward_backward(batch=BATCH)
    run.optim_step()
    (root,) = container_dir.glob(f"runs/*/{run.id}")
    commits = modal_server.backend.instance(TINY_POOL).commits
    before = commits.count
    run.delete()
    assert not root.exists() and commits.count > before
    runtime = modal_server.backend.instance(TINY_POOL).engine
    assert run.id not in runtime.runs


def test_a_4bit_run_gets_a_pool_of_its_own_on_modal(modal_server: LiveServer) -> None:
    client = SignalClient(api_key=modal_server.new_user(), base_url=modal_server.url)
    run = client.create_run(lora_r=4, seed=3, quantization="4bit")
    first = run.forward_backward(batch=BATCH)
    run.optim_step(learning_rate=1e-2)
    assert run.forward_backward(batch=BATCH).loss < first.loss
    pool = pool_key(TINY_MODEL, "L40S:1", "4bit")
    assert pool != TINY_POOL
    engine = modal_server.backend.instance(pool).engine  # its own container, holding the base in 4 bits
    (entry,) = engine.residency.bases.values()
    assert entry.quantization == "4bit" and run.id in engine.runs
    assert any(type(m).__name__ == "Linear4bit" for m in entry.model.modules())


def test_runtime_state_reports_each_pool(modal_server: LiveServer) -> None:
    import asyncio

    state = asyncio.run(modal_server.backend.call(RuntimeState())).state
    assert state["backend"] == "modal" and TINY_POOL in state["pools"]
    assert "resident_runs" in state["pools"][TINY_POOL]


def test_serve_without_modal_credentials_fails_at_start(tmp_path: Path, tiny_model_dir: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MODAL_", "SIGNAL_"))}
    env.update(HOME=str(tmp_path), MODAL_CONFIG_PATH=str(tmp_path / "no-modal.toml"), SIGNAL_BACKEND="modal",
               SIGNAL_DATA_DIR=str(tmp_path / "data"), SIGNAL_PORT="0", SIGNAL_BOOTSTRAP_ADMIN="false",
               PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", "app.cli", "serve"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "MODAL_TOKEN_ID" in output and "MODAL_TOKEN_SECRET" in output and "modal token new" in output
    assert "Signal at" not in output and not (tmp_path / "data" / "signal.db").exists()  # refused before anything


def test_a_multi_gpu_pool_starts_its_ranks_in_the_enter_hook_and_trains(
    tiny_model_dir: str, container_dir: Path, tmp_path: Path
) -> None:
    # The catalogue's own 14B allocation (A100-80GB:2 by the README's table): the container's enter hook starts
    # 2 ranks (offline: 2 CPU processes over gloo) and the base is sharded across them. The weights are the tiny
    # model's; the allocation reads only the declared parameter count.
    catalog = tmp_path / "models.yaml"
    catalog.write_text(f"models:\n  - {{name: signal-tests/declared-14b, path: {tiny_model_dir}, family: llama, "
                       "parameters: 14_700_000_000, offline: true}\n")
    settings = settings_for(tmp_path / "server", tiny_model_dir, backend="modal", models_file=catalog,
                            default_model="signal-tests/declared-14b")
    backend = offline_backend(settings)
    server = LiveServer.start(settings, backend=backend)
    pool = pool_key("signal-tests/declared-14b", "A100-80GB:2", None)
    try:
        client = SignalClient(api_key=server.new_user(), base_url=server.url)
        run = client.create_run(lora_r=4)
        assert run.info.gpu_config == "A100-80GB:2"
        assert run.forward_backward(batch=BATCH).num_tokens > 0
        assert run.optim_step().step == 1
        engine = backend.instance(pool).engine
        assert engine.ranks.world == 2 and engine.ranks.last_pass[1][1] > engine.ranks.last_pass[1][0]  # rank 1 had rows
    finally:
        instance = backend.instance(pool)
        instance.engine.scheduler.close()  # what the exit hook does: its ranks stop, leaving this process's group
        instance.ticks.join(timeout=60)
        server.stop()


def test_a_checkpoint_on_the_volume_downloads_through_the_runtime(modal_server: LiveServer, tmp_path: Path) -> None:
    owner, other = modal_server.new_user(), modal_server.new_user()
    run = SignalClient(api_key=owner, base_url=modal_server.url).create_run(lora_r=4)
    run.forward_backward(batch=BATCH)
    run.optim_step(learning_rate=0.01)
    artifact = run.save_state(mode="state")
    source = Path(artifact.checkpoint_path)  # the container's Volume, which the server cannot read from
    assert not source.is_relative_to(modal_server.settings.data_dir.resolve())

    target = artifact.download(tmp_path / "got")
    expected = {p.relative_to(source): p.read_bytes() for p in source.rglob("*") if p.is_file()}
    assert {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()} == expected
    assert Path("adapter_model.safetensors") in expected
    response = httpx.get(artifact.download_url, headers={"Authorization": f"Bearer {other}"}, timeout=60)
    assert response.status_code == 404  # another user's checkpoint, before the runtime is asked


def test_past_the_export_limit_the_run_page_says_signal_pull_instead_of_a_link(modal_server: LiveServer) -> None:
    """Issue 18 §8: on Modal a checkpoint past the runtime's export limit cannot come through the runtime; the run page
    offers the command that copies it, and the archive URL, asked anyway, is refused naming that command."""
    email = "big-checkpoints@example.com"
    run = SignalClient(api_key=api_key_for(modal_server, email), base_url=modal_server.url).create_run(lora_r=4)
    small, big = run.save_state(mode="state"), run.save_state(mode="merged")
    assert small.size_bytes <= EXPORT_LIMIT < big.size_bytes

    visitor = sign_in(modal_server, email)
    page = visitor.client.get(f"/runs/{run.id}").text
    rows = dict(re.findall(r'<tr data-checkpoint="([^"]+)"[^>]*>(.*?)</tr>', page, re.S))
    assert f"<code>signal pull {run.id}</code>" in rows[f"merged/{big.name}"]
    assert "/archive" not in rows[f"merged/{big.name}"]
    assert f'href="/runs/{run.id}/checkpoints/{small.id}/archive?format=tar"' in rows[f"state/{small.name}"]
    refused = visitor.client.get(big.download_url)
    assert refused.status_code == 422 and f"signal pull {run.id}" in refused.text  # BAD_INPUT


def test_a_pool_deployed_from_other_code_is_refused_naming_modal_deploy(tmp_path: Path) -> None:
    # A stand-in for Modal's cloud: a deployment of an older Signal, whose containers answer ping with version 2.
    class LaggingDeployment:
        calls: list[str] = []

        @classmethod
        def with_options(cls, gpu: str) -> Any:
            return lambda pool, options: cls()

        @property
        def call(self) -> Any:
            def local(method: str, params: dict[str, Any]) -> dict[str, Any]:
                LaggingDeployment.calls.append(method)
                return {"result": {"pid": 1, "contract": CONTRACT_VERSION - 1}}
            return SimpleNamespace(local=local)

    backend = ModalBackend(settings_for(tmp_path, "unused"), lookup=lambda: LaggingDeployment, local=True)
    with pytest.raises(FailedPrecondition) as refused:
        asyncio.run(backend.call(RunInfo(run_id="r"), pool=PoolKey.parse(TINY_POOL)))
    assert refused.value.field == "runtime"
    assert f"contract version {CONTRACT_VERSION - 1}, this server {CONTRACT_VERSION}" in refused.value.message
    assert "modal deploy -m gpu_runtime.modal_app" in refused.value.message
    assert LaggingDeployment.calls == ["ping"]  # the call itself never reached the lagging container


class CrashingDeployment:
    """A stand-in for Modal's cloud: its container is lost (Modal's InternalFailure) with every call whose request id
    starts with "poison", and the connection to Modal fails (ConnectionError) for those starting "unreached"."""

    calls: list[str] = []

    @classmethod
    def with_options(cls, gpu: str) -> Any:
        return lambda pool, options: cls()

    @property
    def call(self) -> Any:
        def local(method: str, params: dict[str, Any]) -> dict[str, Any]:
            request_id = str(params.get("request_id", ""))
            CrashingDeployment.calls.append(request_id)
            if request_id.startswith("poison"):
                raise modal.exception.InternalFailure("the container exited while running the input")
            if request_id.startswith("unreached"):
                raise modal.exception.ConnectionError("could not reach Modal")
            if method == "ping":
                return {"result": {"pid": 1, "contract": CONTRACT_VERSION}}
            return {"result": {"step": 1, "grad_norm": 0.5, "learning_rate": 1e-4}}
        return SimpleNamespace(local=local)


def test_a_call_that_loses_its_container_twice_is_not_sent_again_by_any_server_process(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, "unused")
    first, second = (ModalBackend(settings, lookup=lambda: CrashingDeployment, local=True) for _ in range(2))

    def worker_failed(backend: ModalBackend, request_id: str) -> bool:
        with pytest.raises(WorkerFailed) as failed:
            asyncio.run(backend.call(OptimStep(run_id="r", request_id=request_id), pool=PoolKey.parse(TINY_POOL)))
        return failed.value.retryable

    assert worker_failed(first, "poison-1") is True  # one lost container: maybe not this call's doing
    assert worker_failed(second, "poison-1") is False  # the retry, on another server process: the second in a row
    assert worker_failed(first, "poison-1") is False  # not sent again
    assert [call for call in CrashingDeployment.calls if call == "poison-1"] == ["poison-1"] * 2
    # Failures on this side of the wire count nothing: the call may never have reached a container.
    assert [worker_failed(first, "unreached-1") for _ in range(3)] == [True] * 3
    answered = asyncio.run(second.call(OptimStep(run_id="r", request_id="fine-1"), pool=PoolKey.parse(TINY_POOL)))
    assert answered.step == 1


def test_a_v1_stream_on_modal_is_the_whole_answer_in_one_chunk(modal_server: LiveServer) -> None:
    """A pool answers whole through `.remote()`: a /v1 stream's text comes as one chunk after the sample (docs/MODAL.md)
    and equals the answer without a stream."""
    import openai

    key = modal_server.new_user()
    run = SignalClient(api_key=key, base_url=modal_server.url).create_run(lora_r=4)
    client = openai.OpenAI(api_key=key, base_url=f"{modal_server.url}/v1", max_retries=0)
    ask: dict[str, Any] = {"model": run.id, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    whole = client.completions.create(**ask).choices[0]
    texts = [c.choices[0].text for c in client.completions.create(stream=True, **ask) if c.choices]
    assert [t for t in texts if t] == [whole.text] and whole.text
