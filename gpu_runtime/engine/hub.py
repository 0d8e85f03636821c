"""Push a checkpoint to the Hugging Face Hub, from the runtime: the files are where the runtime is.

The user's HF token is an argument of this one call and goes nowhere else: not into the journal, the
manifest, a log line, or an error message (the Hub's messages are scrubbed of it before they travel).
What goes up: the checkpoint's files, a model card (README.md) whose metadata names the base model,
and the run's manifest.jsonl, so the upload alone says how it was made. Repositories are private
unless asked otherwise. No torch here.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

from gpu_runtime.contract.results import HubUpload
from gpu_runtime.errors import BadInput, HubError

MANIFEST_FILE = "manifest.jsonl"
MODEL_CARD = "README.md"


def check_push(hub_model_id: Any, hf_token: Any) -> tuple[str, str]:
    """Both are needed for a push; the errors name the field in the engine's spelling."""
    if not isinstance(hub_model_id, str) or not hub_model_id.strip():
        raise BadInput("push_to_hub needs hub_model_id (e.g. 'your-name/my-adapter')", field="hub_model_id")
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", hub_model_id) or ".." in hub_model_id:
        raise BadInput(f"hub_model_id must be 'namespace/name' of letters, digits, '-', '_', '.', got {hub_model_id!r}",
                       field="hub_model_id")
    if not isinstance(hf_token, str) or not hf_token.strip():
        raise BadInput("push_to_hub needs an HF token with write access (hf_token)", field="hf_token")
    return hub_model_id, hf_token.strip()


def model_card(hub_model_id: str, base_model: str, mode: str, step: int, run_id: str) -> str:
    library = "transformers" if mode == "merged" else "peft"
    what = "a merged model (base + LoRA)" if mode == "merged" else "a LoRA adapter"
    if mode == "state":
        what += " with its optimizer state (to resume training)"
    return (
        "---\n"
        f"base_model: {base_model}\n"
        f"library_name: {library}\n"
        "tags:\n- signal\n- lora\n"
        "---\n\n"
        f"# {hub_model_id}\n\n"
        f"{what[0].upper() + what[1:]} of `{base_model}`, trained with Signal (run `{run_id}`, step {step}).\n\n"
        f"`{MANIFEST_FILE}` is the run's manifest: the base model and its revision, the LoRA and optimizer\n"
        "settings, the seed, and a hash of every batch with its step.\n"
    )


def push_checkpoint(folder: Path, *, hub_model_id: str, hf_token: str, base_model: str, manifest: Path,
                    mode: str, step: int, run_id: str, private: bool = True) -> HubUpload:
    """Create the repo (private, or left as it is when it exists) and upload the checkpoint in one commit."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HFValidationError

    # A staging folder beside the checkpoint: hard links, plus the card and the manifest (the checkpoint is untouched).
    staging = folder.parent / f".hub-{folder.name}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        for source in folder.rglob("*"):
            if source.is_file():
                target = staging / source.relative_to(folder)
                target.parent.mkdir(parents=True, exist_ok=True)
                _link_or_copy(source, target)
        if manifest.is_file():
            _link_or_copy(manifest, staging / MANIFEST_FILE)
        (staging / MODEL_CARD).write_text(model_card(hub_model_id, base_model, mode, step, run_id))
        api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=hf_token)
        try:
            repo = api.create_repo(hub_model_id, private=private, exist_ok=True, repo_type="model")
            commit = api.upload_folder(repo_id=repo.repo_id, folder_path=staging, repo_type="model",
                                       commit_message=f"Signal: {mode} of run {run_id} at step {step}")
        except HFValidationError as exc:
            raise BadInput(_scrub(str(exc), hf_token), field="hub_model_id") from None
        except Exception as exc:  # noqa: BLE001 - HTTP errors, refused LFS batches, unreachable hosts: all the Hub's
            raise HubError(f"the Hub refused the upload to {hub_model_id!r}: {_scrub(str(exc), hf_token)}",
                           field="hub_model_id") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"repo_id": repo.repo_id, "url": str(repo), "commit": commit.oid, "private": private}


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _scrub(message: str, token: str) -> str:
    return message.replace(token, "***") if token else message
