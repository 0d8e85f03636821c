"""Checkpoints explained on the run page (issue 18 §8): one line per kind with its size before saving, and a
"how to load this" snippet for each kind saved, which runs as shown."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer
from tests.web.conftest import Visitor, api_key_for

BATCH = [{"input": "The quick brown fox", "output": " jumps over the lazy dog."}]


def snippet(page: str, mode: str) -> str:
    match = re.search(rf'<pre class="code" tabindex="0" id="load-{mode}">(.*?)</pre>', page, re.DOTALL)
    assert match, f"no {mode} snippet"
    return html.unescape(match.group(1))


def test_each_kind_is_explained_with_its_size_and_loads_as_shown(
        live_server: LiveServer, visitor: Visitor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = api_key_for(live_server, visitor.email)
    run = SignalClient(api_key=key, base_url=live_server.url).create_run(lora_r=4, seed=4)
    run.forward_backward(batch=BATCH)
    run.optim_step()
    adapter = run.save_state(mode="adapter")
    run.save_state(mode="merged")
    run.save_state(mode="state", name="resume-here")
    page = visitor.client.get(f"/runs/{run.id}").text

    lines = dict(re.findall(r'<li data-mode="(\w+)"><strong>\w+</strong> \(about ([^)]+)\)', page))
    assert list(lines) == ["adapter", "merged", "state"]
    estimate = float(lines["adapter"].split()[0]) * {"B": 1, "KB": 1e3, "MB": 1e6}[lines["adapter"].split()[1]]
    assert adapter.size_bytes / 2 < estimate < adapter.size_bytes * 2, (lines, adapter.size_bytes)

    assert f'from_checkpoint="signal://{run.id}/state/resume-here"' in snippet(page, "state")
    assert "PeftModel.from_pretrained(base, folder)" in snippet(page, "adapter")
    # The merged snippet, run as a user would paste it: it downloads the checkpoint and transformers loads it.
    monkeypatch.setenv("SIGNAL_API_KEY", key)
    monkeypatch.chdir(tmp_path)
    scope: dict[str, object] = {}
    exec(snippet(page, "merged"), scope)  # noqa: S102 - the page's own snippet, run as a user would
    model = scope["model"]
    shown = re.search(r"<dt>Trainable parameters</dt><dd>([\d,]+) of ([\d,]+)</dd>", page)
    assert shown
    lora, total = (int(group.replace(",", "")) for group in shown.groups())
    # The base's own parameters: the LoRA is folded into them, none added (the run's total counts the LoRA's too).
    assert sum(p.numel() for p in model.parameters()) == total - lora  # type: ignore[attr-defined]
    assert Path(str(scope["folder"])).resolve().parent == tmp_path.resolve()  # unpacked where the user ran it
