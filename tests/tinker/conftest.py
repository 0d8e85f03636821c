"""The real `tinker==0.38.0` SDK against a live Signal server (tests/helpers/live_server.py) on the tiny model.

The SDK is imported here, in the test process, never by the server (app/ loads only its protobuf module by path).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.helpers.live_server import TINY_MODEL, LiveServer, settings_for

os.environ.setdefault("TINKER_TELEMETRY", "0")
CONTEXT_LENGTH = 16  # the test catalogue's context window for the tiny model  # the SDK's telemetry loop: served as a no-op anyway


@pytest.fixture(scope="module")
def live_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The live server, its catalogue's tiny model naming its own directory as its tokenizer (get_info's
    tokenizer_id), so TrainingClient.get_tokenizer() loads it offline (research note §10), and a small context
    window. Test configuration: the product's catalogue says what each model really has."""
    # The catalogue's own tokenizer (a local directory) as get_info's tokenizer_id, not the runtime's copy that a
    # default local server serves (tinker_tokenizer_dir): these tests check the catalogue's entry reaches the SDK.
    settings = settings_for(tmp_path_factory.mktemp("tinker-data"), tiny_model_dir, tinker_tokenizer_dir=False)
    catalog = yaml.safe_load(settings.models_file.read_text())
    for model in catalog["models"]:
        if model["name"] == TINY_MODEL:
            model["tokenizer"] = tiny_model_dir
            model["context_length"] = CONTEXT_LENGTH  # what max_tokens: null fills up to (the model has more)
    settings.models_file.write_text(yaml.safe_dump(catalog))
    server = LiveServer.start(settings)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tinker_key(live_server: LiveServer) -> str:
    """A fresh user's Signal key in Tinker's form: `tml-` followed by the whole key (`tml-sk-…`)."""
    return "tml-" + live_server.new_user()


@pytest.fixture(scope="module")
def service_client(live_server: LiveServer, tinker_key: str) -> Iterator[Any]:
    import tinker

    client = tinker.ServiceClient(base_url=live_server.url, api_key=tinker_key)
    yield client
    client.holder.close() if hasattr(client, "holder") else None
