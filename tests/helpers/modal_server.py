"""A live server on the Modal backend, through Modal's own offline path (`.local()` of the app's class).

Modal's cloud cannot be reached from here; this is the one stand-in, at that boundary. The "container" gets a
data directory of its own (its Volume), apart from the server's, as `runtime_data_dir`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.live_server import LiveServer, settings_for

# `.local()` warns that no Volume is mounted: that is the point of the offline path.
LOCAL_WARNING = "ignore:The .* function is executing locally:UserWarning"


def modal_live_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from app.backends.modal import ModalBackend
    from gpu_runtime import modal_app

    volume = tmp_path_factory.mktemp("modal-volume")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(modal_app.DATA_DIR_ENV, str(volume))
        patch.setenv(modal_app.DEVICE_ENV, "cpu")
        patch.setenv(modal_app.DOWNLOADS_ENV, "0")  # the Hub cannot be reached from here: fail fast, as a worker does
        settings = settings_for(tmp_path_factory.mktemp("modal-server"), tiny_model_dir, backend="modal")
        server = LiveServer.start(settings, backend=ModalBackend(settings, lookup=lambda: modal_app.Pool, local=True))
        server.runtime_data_dir = volume  # type: ignore[attr-defined]
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="module", params=["local", "modal"], name="live_server")
def live_server_on_both_backends(request: pytest.FixtureRequest, live_server: LiveServer, tiny_model_dir: str,
                                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A module's API tests on the local runtime and on the Modal backend's offline path (the same runtime in a Modal
    class). Imported into a test module, it overrides `live_server` there (its fixture name): every test runs on both."""
    if request.param == "local":
        yield live_server
    else:
        yield from modal_live_server(tiny_model_dir, tmp_path_factory)


def runtime_data_dir(server: LiveServer):  # type: ignore[no-untyped-def]
    """Where the server's runtime keeps run files: the server's data dir locally, the Volume on Modal."""
    return getattr(server, "runtime_data_dir", server.settings.data_dir)
