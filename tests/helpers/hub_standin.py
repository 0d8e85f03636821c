"""A stand-in for the Hugging Face Hub, FOR TESTS ONLY: it is not the Hub and not part of Signal.

It answers exactly the HTTP calls huggingface_hub 2.4.0 makes for `HfApi.create_repo` and
`HfApi.upload_folder` with Xet disabled (HF_HUB_DISABLE_XET=1), read from huggingface_hub's own source
(hf_api.py create_repo, _commit_api.py _fetch_upload_modes/_upload_files/_send_commit, lfs.py):

- POST /api/repos/create                              {name, organization, visibility, type} → {url}; 409 if it exists
- POST /api/validate-yaml                             {content, repoType}: a README.md's metadata block (YAML) → {warnings}
- POST /api/models/{repo}/preupload/{revision}        {files: [{path, sample, size}]} → {files: [{path, uploadMode, shouldIgnore}]}
- POST /{repo}.git/info/lfs/objects/batch             git-lfs batch API: upload actions (basic transfer) + verify
- PUT  /lfs-objects/{oid}                             the upload action's URL: the object's bytes (sha256 checked)
- POST /{repo}.git/info/lfs/objects/verify            {oid, size}
- POST /api/models/{repo}/commit/{revision}           NDJSON: header, file (base64), lfsFile (sha256 oid) → {commitUrl, commitOid}

It runs uvicorn on 127.0.0.1 in a thread and records what arrived (repos, files, Authorization headers),
so a test reads the upload as the Hub would have stored it. Requests must carry `Bearer {token}`.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import socket
import threading
import uuid
from dataclasses import dataclass, field

import uvicorn
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


@dataclass
class StoredRepo:
    private: bool
    files: dict[str, bytes] = field(default_factory=dict)
    commits: list[str] = field(default_factory=list)


@dataclass
class HubStandIn:
    token: str
    url: str = ""
    repos: dict[str, StoredRepo] = field(default_factory=dict)
    lfs_objects: dict[str, bytes] = field(default_factory=dict)
    authorizations: list[str] = field(default_factory=list)  # the Authorization header of every request
    calls: list[str] = field(default_factory=list)  # "METHOD /path" of every request, in order
    # A test that holds uploads sets `release`: each commit then signals `committing` and waits for `release`.
    release: threading.Event | None = None
    committing: threading.Event = field(default_factory=threading.Event)
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None

    # ---- serving -----------------------------------------------------------------------------

    def start(self) -> HubStandIn:
        # Bound and listening before uvicorn runs: connections wait in the backlog, so nothing polls for readiness.
        listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        app = Starlette(routes=[
            Route("/api/repos/create", self._create_repo, methods=["POST"]),
            Route("/api/validate-yaml", self._validate_yaml, methods=["POST"]),
            Route("/api/models/{repo:path}/preupload/{revision}", self._preupload, methods=["POST"]),
            Route("/api/models/{repo:path}/commit/{revision}", self._commit, methods=["POST"]),
            Route("/{repo:path}.git/info/lfs/objects/batch", self._lfs_batch, methods=["POST"]),
            Route("/{repo:path}.git/info/lfs/objects/verify", self._lfs_verify, methods=["POST"]),
            Route("/lfs-objects/{oid}", self._lfs_put, methods=["PUT"]),
        ])
        app.add_exception_handler(404, self._unknown)
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        server = self._server
        self._thread = threading.Thread(target=lambda: server.run(sockets=[listener]), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ---- the Hub's calls ------------------------------------------------------------------------

    async def _authorized(self, request: Request) -> Response | None:
        header = request.headers.get("authorization", "")
        self.authorizations.append(header)
        self.calls.append(f"{request.method} {request.url.path}")
        if header != f"Bearer {self.token}":
            # The Hub's own wording and shape for a bad token.
            return JSONResponse({"error": "Invalid credentials in Authorization header"}, status_code=401)
        return None

    async def _create_repo(self, request: Request) -> Response:
        if (refused := await self._authorized(request)) is not None:
            return refused
        body = await request.json()
        repo_id = f"{body.get('organization') or 'standin-user'}/{body['name']}"
        if repo_id in self.repos:
            return JSONResponse({"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"},
                                status_code=409)
        self.repos[repo_id] = StoredRepo(private=body.get("visibility") == "private")
        return JSONResponse({"url": f"{self.url}/{repo_id}", "name": repo_id, "id": uuid.uuid4().hex})

    async def _validate_yaml(self, request: Request) -> Response:
        if (refused := await self._authorized(request)) is not None:
            return refused
        content = (await request.json())["content"]
        try:
            # README.md's metadata is the YAML between its first two `---` lines.
            metadata = yaml.safe_load(content.split("---")[1]) if content.startswith("---") else {}
        except yaml.YAMLError as exc:
            return JSONResponse({"errors": [{"message": f"invalid YAML: {exc}"}]}, status_code=400)
        if not isinstance(metadata, dict):
            return JSONResponse({"errors": [{"message": "metadata must be a mapping"}]}, status_code=400)
        return JSONResponse({"warnings": [] if metadata else [{"message": "empty or missing yaml metadata"}]})

    async def _preupload(self, request: Request) -> Response:
        if (refused := await self._authorized(request)) is not None:
            return refused
        if (missing := self._missing(request)) is not None:
            return missing
        files = (await request.json())["files"]
        answer = []
        for item in files:
            sample = base64.b64decode(item["sample"])
            binary = b"\x00" in sample or item["path"].endswith((".safetensors", ".bin", ".pt"))
            answer.append({"path": item["path"], "uploadMode": "lfs" if binary else "regular", "shouldIgnore": False,
                           "oid": None})
        return JSONResponse({"files": answer, "commitOid": None})

    async def _lfs_batch(self, request: Request) -> Response:
        if (refused := await self._authorized(request)) is not None:
            return refused
        if (missing := self._missing(request)) is not None:
            return missing
        body = await request.json()
        assert body["operation"] == "upload" and "basic" in body["transfers"], body
        repo = request.path_params["repo"]
        objects = []
        for item in body["objects"]:
            actions = {"upload": {"href": f"{self.url}/lfs-objects/{item['oid']}", "header": {}},
                       "verify": {"href": f"{self.url}/{repo}.git/info/lfs/objects/verify", "header": {}}}
            objects.append({"oid": item["oid"], "size": item["size"], "authenticated": True, "actions": actions})
        return JSONResponse({"transfer": "basic", "objects": objects, "hash_algo": "sha256"})

    async def _lfs_put(self, request: Request) -> Response:
        # The upload action's URL is pre-signed on the real Hub (S3): no Authorization header is expected here.
        self.calls.append(f"PUT {request.url.path}")
        data = await request.body()
        oid = request.path_params["oid"]
        if hashlib.sha256(data).hexdigest() != oid:
            return Response("sha256 mismatch", status_code=400)
        self.lfs_objects[oid] = data
        return Response(status_code=200)

    async def _lfs_verify(self, request: Request) -> Response:
        if (refused := await self._authorized(request)) is not None:
            return refused
        body = await request.json()
        if len(self.lfs_objects.get(body["oid"], b"")) != body["size"]:
            return JSONResponse({"message": "object not uploaded"}, status_code=404)
        return JSONResponse({})

    async def _commit(self, request: Request) -> Response:
        if (refused := await self._authorized(request)) is not None:
            return refused
        if (missing := self._missing(request)) is not None:
            return missing
        assert request.headers.get("content-type") == "application/x-ndjson"
        if self.release is not None:
            self.committing.set()
            await asyncio.to_thread(self.release.wait, 60)
        lines = [json.loads(line) for line in (await request.body()).decode().splitlines() if line.strip()]
        assert lines[0]["key"] == "header", lines[0]
        repo = self.repos[request.path_params["repo"]]
        for line in lines[1:]:
            value = line["value"]
            if line["key"] == "file":
                assert value["encoding"] == "base64"
                repo.files[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] == "lfsFile":
                if value["oid"] not in self.lfs_objects:
                    return JSONResponse({"error": f"LFS object {value['oid']} was never uploaded"}, status_code=400)
                repo.files[value["path"]] = self.lfs_objects[value["oid"]]
            else:
                return JSONResponse({"error": f"the stand-in does not do {line['key']}"}, status_code=400)
        oid = hashlib.sha1(uuid.uuid4().bytes).hexdigest()
        repo.commits.append(lines[0]["value"]["summary"])
        return JSONResponse({"commitUrl": f"{self.url}/{request.path_params['repo']}/commit/{oid}", "commitOid": oid,
                             "success": True})

    def _missing(self, request: Request) -> Response | None:
        if request.path_params["repo"] not in self.repos:
            return JSONResponse({"error": "Repository not found"}, status_code=404)
        return None

    async def _unknown(self, request: Request, exc: Exception) -> Response:
        self.calls.append(f"UNKNOWN {request.method} {request.url.path}")  # a call huggingface_hub makes that we lack
        return JSONResponse({"error": f"the hub stand-in has no {request.method} {request.url.path}"}, status_code=404)
