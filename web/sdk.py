"""The SDK's wheel, served by the server it talks to: `pip install <server>/sdk/<wheel>` on any machine.

`make install` builds the wheel into SIGNAL_SDK_DIR (the venv's share/signal/sdk); a server without one serves
nothing here and Getting started shows the checkout's `pip install ./rewardsignal` instead. Public: the SDK is no
secret, and pip sends no cookie.
"""

from __future__ import annotations

import re
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, Response
from starlette.routing import Route

from web.render import services

# pip reads the name, version and tags from the file name, so the URL keeps the wheel's own name.
WHEEL_NAME = re.compile(r"rewardsignal-[0-9][A-Za-z0-9.+!]*-py3-none-any\.whl")


def sdk_wheel(directory: Path) -> Path | None:
    """The SDK wheel in `directory` (the newest by modification time, should there be several), or None."""
    wheels = [p for p in directory.glob("rewardsignal-*.whl") if WHEEL_NAME.fullmatch(p.name)] \
        if directory.is_dir() else []
    return max(wheels, key=lambda p: p.stat().st_mtime, default=None)


def sdk_install_command(request: Request) -> str:
    """What Getting started prints: the served wheel's URL where the server has one, else the checkout's folder."""
    settings = services(request).settings
    wheel = sdk_wheel(settings.sdk_dir)
    if wheel is None:
        return "pip install ./rewardsignal  # from a checkout of this repository"
    return f"pip install {settings.resolved_public_url}/sdk/{wheel.name}"


async def wheel_file(request: Request) -> Response:
    wheel = sdk_wheel(services(request).settings.sdk_dir)
    if wheel is None or request.path_params["name"] != wheel.name:
        return Response("No such file: this server serves the SDK's wheel at /sdk/.", status_code=404,
                        media_type="text/plain")
    return FileResponse(wheel, media_type="application/octet-stream")


async def index(request: Request) -> Response:
    """A links page, so `pip install --find-links <server>/sdk/ rewardsignal` works too."""
    wheel = sdk_wheel(services(request).settings.sdk_dir)
    links = f'<a href="/sdk/{wheel.name}">{wheel.name}</a>' if wheel else ""
    return HTMLResponse(f"<!doctype html><title>Signal SDK</title>{links}")


routes = [
    Route("/sdk/", index),
    Route("/sdk/{name}", wheel_file),
]
