"""Schemathesis's check for Signal's GraphQL API (issue 19): a generated request fails only on HTTP 5xx or an
error whose `extensions.code` is INTERNAL. Its default checks would also fail on every correct BAD_INPUT.

Registered on import (`@schemathesis.check`): the short form (test_graphql_fuzz.py) imports it, and `make fuzz`
names it to the CLI through SCHEMATHESIS_HOOKS=tests.fuzz.checks.
"""

from __future__ import annotations

import json
from typing import Any

import schemathesis

# Not fuzzed: they end the key the fuzzer is signed in with, or the runs it has made.
EXCLUDED = ("Mutation.revokeApiKey", "Mutation.deleteRun")
# The server's bounds while fuzzed: small, so the largest call the schema lets through stays quick on a CPU.
SMALL_BOUNDS: dict[str, Any] = {"max_batch_size": 4, "max_batch_tokens": 256, "max_sample_rows": 4,
                                "max_sample_tokens": 64, "max_sample_prompt_tokens": 256, "max_request_bytes": 64 * 1024,
                                "max_user_calls_in_flight": 4, "max_user_calls_waiting": 4}


def internal_errors(body: Any) -> list[dict[str, Any]]:
    errors = body.get("errors") if isinstance(body, dict) else None
    return [error for error in errors or [] if isinstance(error, dict)
            and (error.get("extensions") or {}).get("code") == "INTERNAL"]


@schemathesis.check
def no_server_error(ctx: Any, response: Any, case: Any) -> bool | None:
    """No 5xx and no INTERNAL: a typed 4xx-class error (BAD_INPUT, NOT_FOUND, ...) is the correct answer to bad input."""
    if response.status_code >= 500:
        raise AssertionError(f"HTTP {response.status_code}: {response.text[:400]}")
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"not JSON (HTTP {response.status_code}): {response.text[:400]}") from None
    internal = internal_errors(body)
    if internal:
        raise AssertionError(f"INTERNAL: {internal[0].get('message')!r} at {internal[0].get('path')}")
    return None
