"""`make fuzz`, the long form (issue 19): a live server on the tiny model with small bounds, and Schemathesis's CLI
against its /graphql for --max-time seconds, with an API key, its checks replaced by tests/fuzz/checks.py's.

    .venv/bin/python -m tests.fuzz.long [--max-time 120]

Exits with the CLI's status: 0 when no generated request got HTTP 5xx or INTERNAL.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from rewardsignal import SignalClient
from tests.fuzz.checks import EXCLUDED, SMALL_BOUNDS
from tests.helpers.live_server import LiveServer, settings_for
from tests.helpers.tiny_model import build_tiny_model

REPO = Path(__file__).resolve().parents[2]


def fuzz_config(run_id: str) -> str:
    """Schemathesis's config: the fuzzer's own run as most runIds (else every primitive is NOT_FOUND, and their
    logic is never reached), and seq mostly 1 (a session's first call, which waits for none)."""
    return f"""
[dictionaries.runs]
values = ["{run_id}"]

[dictionaries.first]
values = [1]

[parameters]
"*.*.runId" = {{ dictionary = "runs", probability = 0.8 }}
"Query.run.id" = {{ dictionary = "runs", probability = 0.8 }}
"*.*.seq" = {{ dictionary = "first", probability = 0.9 }}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--max-time", type=int, default=120, help="Schemathesis's time budget, in seconds")
    args = parser.parse_args()
    cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or "schemathesis"
    with tempfile.TemporaryDirectory(prefix="signal-fuzz-") as scratch:
        model = build_tiny_model(Path(scratch) / "tiny-llama", tokenizer_cache=Path(scratch) / "tokenizer")
        server = LiveServer.start(settings_for(Path(scratch) / "data", model, **SMALL_BOUNDS))
        try:
            key = server.new_user()
            config = Path(scratch) / "schemathesis.toml"
            config.write_text(fuzz_config(SignalClient(api_key=key, base_url=server.url).create_run(lora_r=2).id))
            # A call numbered past its session's next (seq) waits up to 60 s for the ones before it (call_order.py):
            # answered, not hung, so the timeout is above that, and workers keep the budget going meanwhile.
            command = [cli, "--config-file", str(config), "run", f"{server.url}/graphql",
                       "--header", f"Authorization: Bearer {key}", "--checks", "no_server_error",
                       "--max-time", str(args.max_time), "--workers", "4", "--request-timeout", "90",
                       *[arg for name in EXCLUDED for arg in ("--exclude-name", name)]]
            env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.fuzz.checks",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
            return subprocess.run(command, env=env, cwd=REPO, check=False).returncode
        finally:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
