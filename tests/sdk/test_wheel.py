"""The SDK as its own distribution: its wheel, built from ./rewardsignal alone, in a fresh venv that borrows httpx
and httpx's own dependencies from the test venv and nothing else, trains a run against a live server; torch is
not there to import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.helpers.live_server import LiveServer
from tests.helpers.wheels import HTTPX_CLOSURE, REPO, SDK, borrow, build_wheel, fresh_venv

SCRIPT = """
import importlib.util, json, sys
try:
    import torch  # noqa: F401
    torch_error = None
except ModuleNotFoundError as error:
    torch_error = str(error)
import rewardsignal, rewardsignal.operations as operations
from rewardsignal import SignalClient

client = SignalClient(api_key=sys.argv[1], base_url=sys.argv[2])
run = client.create_run(lora_r=4, seed=3)
batch = [{"text": "a wheel of its own trains too"}]
first = run.forward_backward(batch=batch)
step = run.optim_step(learning_rate=0.05)
second = run.forward_backward(batch=batch)
print(json.dumps({
    "torch_error": torch_error, "sdk": rewardsignal.__file__, "operations": str(operations.OPERATIONS_DIR),
    "first": first.loss, "second": second["loss"], "step": step.step, "type": type(first).__name__,
    "path": sys.path, "ours": sorted(m for m in sys.modules if m.split(".")[0] in ("app", "gpu_runtime", "web")),
}))
"""


def test_the_sdk_wheel_holds_its_documents_and_trains_without_torch(live_server: LiveServer, key: str,
                                                                    tmp_path: Path) -> None:
    wheel = build_wheel(SDK, tmp_path / "dist")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"rewardsignal/graphql/ForwardBackward.graphql", "rewardsignal/graphql/fragments.graphql",
            "rewardsignal/graphql/Limits.graphql", "rewardsignal/py.typed"} <= set(names)
    assert not [n for n in names if n.split("/")[0] in ("app", "gpu_runtime", "web", "tests")], names
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/METADATA"))).decode()
    assert [line for line in metadata.splitlines() if line.startswith("Requires-Dist")] == ["Requires-Dist: httpx==0.28.1"]

    python, purelib = fresh_venv(tmp_path / "venv", [wheel])
    borrow(purelib, HTTPX_CLOSURE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    done = subprocess.run([str(python), "-I", "-c", SCRIPT, key, live_server.url], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["torch_error"] == "No module named 'torch'"
    assert Path(seen["sdk"]).is_relative_to(purelib) and Path(seen["operations"]).is_relative_to(purelib)
    assert not any(Path(p).is_relative_to(REPO) or p.startswith(sys.prefix) for p in seen["path"]), seen["path"]
    assert seen["ours"] == []
    assert seen["type"] == "ForwardBackwardResult" and seen["step"] == 1
    assert seen["second"] < seen["first"]
