"""A Hub upload runs off the runtime's tick: while one run's checkpoint uploads, other runs' calls are answered,
and that run's own next call waits for the upload. The Hub is tests/helpers/hub_standin.py (the network
boundary, tests only), with its commit held until the test releases it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import huggingface_hub.constants
import pytest

from gpu_runtime.engine.engine import Engine
from tests.helpers.engine_tools import BATCH, result_of, submit
from tests.helpers.hub_standin import HubStandIn

HF_TOKEN = "hf_upload_test_token"
# huggingface_hub's LFS upload passes raw bytes as httpx's `data=` (its own deprecation, not ours).
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[HubStandIn]:
    standin = HubStandIn(token=HF_TOKEN, release=threading.Event()).start()
    monkeypatch.setenv("HF_ENDPOINT", standin.url)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)  # the stand-in speaks LFS, not Xet
    yield standin
    standin.release.set()  # type: ignore[union-attr]
    standin.stop()


def test_an_upload_holds_only_its_own_run(engine: Engine, tiny_model_dir: str, hub: HubStandIn) -> None:
    for run_id in ("uploader", "other"):
        engine.create_run(run_id, "u1", tiny_model_dir, {"r": 4, "alpha": 8})
    saved = submit(engine, "save_state", run_id="uploader", mode="adapter", push_to_hub=True,
                   hub_model_id="alice/held", hf_token=HF_TOKEN)
    engine.tick()  # writes the checkpoint and starts the upload
    assert hub.committing.wait(60), "the upload never reached the Hub's commit"

    after_save = submit(engine, "forward_backward", run_id="uploader", batch=BATCH)
    other = submit(engine, "forward_backward", run_id="other", batch=BATCH)
    engine.tick()
    assert result_of(other)["step"] == 0  # answered while the upload is held
    assert not saved.done() and not after_save.done()  # the uploading run's next call keeps its place

    hub.release.set()  # type: ignore[union-attr]
    message = saved.result(timeout=60)
    assert message["result"]["hub"]["url"] == f"{hub.url}/alice/held", message
    assert "adapter_model.safetensors" in hub.repos["alice/held"].files
    engine.tick()
    assert result_of(after_save)["step"] == 0


def test_a_refused_upload_answers_its_call_with_the_hubs_error(engine: Engine, tiny_model_dir: str,
                                                              hub: HubStandIn) -> None:
    hub.release.set()  # type: ignore[union-attr]
    engine.create_run("r", "u1", tiny_model_dir, {"r": 4, "alpha": 8})
    saved = submit(engine, "save_state", run_id="r", mode="adapter", push_to_hub=True,
                   hub_model_id="alice/refused", hf_token="hf_wrong", name="pushed")
    engine.tick()
    message = saved.result(timeout=60)
    assert message["error"]["code"] == "HUB_ERROR" and "hf_wrong" not in message["error"]["message"], message
    assert engine.forward_backward("r", BATCH)["step"] == 0  # the run goes on
    # The failed push took back the checkpoint it wrote: nothing unlisted keeps the name, so saving it works.
    assert not (engine.data_dir / "runs" / "u1" / "r" / "checkpoints" / "adapter" / "pushed").exists()
    assert engine.call("save_state", run_id="r", mode="adapter", name="pushed")["name"] == "pushed"
