"""The /v1 tool tests' server: the tiny model under each tool template of tests/fixtures/chat_templates, as base
models `tiny-{family}` (SmolLM2's own template takes no tools)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import yaml

from tests.helpers.live_server import LiveServer, settings_for, write_catalog
from tests.helpers.tiny_model import with_chat_template

TOOL_FAMILIES = ("hermes", "llama3_json", "gpt_oss")


@pytest.fixture(scope="module")
def tool_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data_dir = tmp_path_factory.mktemp("signal-tools")
    catalog = write_catalog(data_dir / "models-tools.yaml", tiny_model_dir)  # settings_for writes models.yaml
    models = yaml.safe_load(catalog.read_text())
    for family in TOOL_FAMILIES:
        path = with_chat_template(tiny_model_dir, tmp_path_factory.mktemp(f"tiny-{family}") / "tiny-llama", family)
        models["models"].append({"name": f"tiny-{family}", "path": path, "family": "llama", "parameters": 1_000_000,
                                 "offline": True, "description": f"the tiny Llama with a {family} tool template"})
    catalog.write_text(yaml.safe_dump(models))
    server = LiveServer.start(settings_for(data_dir, tiny_model_dir, models_file=catalog))
    yield server
    server.stop()
