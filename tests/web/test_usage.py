"""The Usage page (issue 18 §6): a user's compute seconds, cost and tokens trained and sampled, in all, by day and by
run, read from the call records; an admin sees every user's, and another user's page is not found for anyone else."""

from __future__ import annotations

import html
import json
import re
from datetime import UTC, datetime, timedelta

import pytest

from app.db import Database
from app.services.users import UserService
from app.tables import CallRecord
from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer
from tests.web.conftest import api_key_for, run_async, sign_in

BATCH = [{"text": "The quick brown fox jumps over the lazy dog."}]
RUN = "query($id: ID!) { run(id: $id) { computeSeconds } }"


def user_id(server: LiveServer, email: str) -> str:
    async def find() -> str:
        db = Database(server.settings.resolved_database_url)
        try:
            return (await UserService(db).get_or_create(email))[0].id
        finally:
            await db.dispose()

    return str(run_async(find()))


def row(html: str, attribute: str) -> list[str]:
    """The cells of the table row marked `data-…="…"` (`attribute`), tags dropped."""
    found = re.search(rf'<tr {re.escape(attribute)}>(.*?)</tr>', html, re.S)
    assert found, f"no row {attribute} on the page"
    return [re.sub(r"<[^>]+>", "", cell).strip() for cell in re.findall(r"<td[^>]*>(.*?)</td>", found.group(1), re.S)]


def test_usage_adds_up_a_users_calls_and_an_admin_sees_every_user(live_server: LiveServer) -> None:
    email = "usage@example.com"
    key = api_key_for(live_server, email)
    run = SignalClient(api_key=key, base_url=live_server.url).create_run(lora_r=4, name="usage run")
    trained = run.forward_backward(batch=BATCH).num_tokens
    run.optim_step()
    # The same prompt twice: the second call finds all but its last token in the decode cache (its last token's pass
    # gives the first logits).
    prompt = "The quick brown fox jumps over the lazy dog. " * 4  # whole blocks of the cache's prefix index
    samples = [run.sample(prompts=[prompt], max_tokens=5, num_samples=2, seed=seed) for seed in (1, 2)]
    generated = sum(len(sequence["tokens"]) for sampled in samples for made in sampled.sequences for sequence in made)
    prompted = sum(len(ids) * len(made) for sampled in samples for ids, made in zip(sampled.prompt_tokens,
                                                                                   sampled.sequences))
    cached = sum(sampled.prompt_cache_hit_tokens for sampled in samples)
    assert samples[1].prompt_cache_hit_tokens == len(samples[1].prompt_tokens[0]) - 1
    seconds = live_server.graphql(RUN, {"id": run.id}, key=key)["data"]["run"]["computeSeconds"]
    assert seconds > 0
    # calls, compute seconds, GPU-seconds (none on the CPU), credits (the CPU rate is 0), tokens trained and sampled,
    # prompt tokens and those of them found in the cache
    expected = ["4", f"{seconds:.1f}", "0.0", "0.00", f"{trained:,}", f"{generated:,}", f"{prompted:,}", f"{cached:,}"]

    owner = sign_in(live_server, email)
    page = owner.client.get("/usage")
    assert page.status_code == 200
    assert row(page.text, 'data-usage="total"') == ["Total", *expected]
    assert row(page.text, f'data-run="{run.id}"') == ["usage run by day", *expected]
    today = datetime.now(UTC).date().isoformat()
    assert row(page.text, f'data-day="{today}"') == [today, *expected]
    assert "By user" not in page.text  # an admin's table only
    # The runs list counts the same tokens trained, and says how long the run has been going.
    listed = owner.client.get("/runs").text
    cells = re.search(rf'<tr data-run-id="{run.id}">(.*?)</tr>', listed, re.S)
    assert cells
    assert f'data-cell="tokens">{trained:,}<' in cells.group(1)
    assert re.search(r'data-cell="duration">\d+ (s|min)<', cells.group(1)) and 'data-cell="activity">just now<' in cells.group(1)
    # The chart draws the same day (static/usage.js reads data-days): [day, compute seconds, credits].
    found = re.search(r'data-days="([^"]*)"', page.text)
    assert found
    assert json.loads(html.unescape(found.group(1))) == [[today, pytest.approx(seconds, abs=1e-3), 0.0]]

    # The same numbers through GraphQL and the SDK's `usage`: the total, the run's line and today's.
    usage = SignalClient(api_key=key, base_url=live_server.url).usage(days=7)
    assert (usage.days, [line.key for line in usage.by_run], [line.key for line in usage.by_day]) == (7, [run.id], [today])
    assert [[str(line.calls), f"{line.compute_seconds:.1f}", f"{line.gpu_seconds:.1f}", f"{line.credits:.2f}",
             f"{line.tokens_trained:,}", f"{line.tokens_sampled:,}", f"{line.tokens_prompted:,}", f"{line.tokens_cached:,}"]
            for line in (usage.total, usage.by_run[0], usage.by_day[0])] == [expected] * 3

    someone = sign_in(live_server)
    assert someone.client.get(f"/usage?user={user_id(live_server, email)}").status_code == 404
    assert row(someone.client.get("/usage").text, 'data-usage="total"')[1] == "0"  # their own: no calls
    assert someone.client.get("/usage?days=0").status_code == 422

    admin = sign_in(live_server, "usage-admin@example.com", is_admin=True)
    listed = admin.client.get("/usage?days=7").text
    owner_id = user_id(live_server, email)
    assert row(listed, f'data-user="{owner_id}"') == [email, *expected]
    theirs = admin.client.get(f"/usage?user={owner_id}").text
    assert f"{email}'s calls since" in theirs  # whose page it is
    assert row(theirs, f'data-run="{run.id}"') == ["usage run by day", *expected]


# (run, days ago, gpu seconds, credits, tokens trained): GPU calls as a Modal worker would record them.
GPU_CALLS = [("a", 0, 12.5, 1.25, 100), ("a", 1, 4.0, 0.5, 40), ("b", 0, 2.25, 0.75, 10)]
USAGE = "query($days: Int!) { usage(days: $days) { total { calls gpuSeconds credits tokensTrained } " \
        "byDay { key calls gpuSeconds credits } byRun { key calls gpuSeconds credits } } }"


def test_gpu_seconds_and_cost_add_up_per_day_and_per_run(live_server: LiveServer) -> None:
    """The CPU records 0 GPU-seconds and 0 credits, so the sums are checked on call records written straight into
    the server's database, as a GPU worker's calls would be (this is the read path only; writing them is
    tests/app's)."""
    email = "usage-gpu@example.com"
    key = api_key_for(live_server, email)
    client = SignalClient(api_key=key, base_url=live_server.url)
    runs = {name: client.create_run(lora_r=4, name=f"gpu {name}").id for name in ("a", "b")}
    owner_id = user_id(live_server, email)
    now = datetime.now(UTC)

    async def record() -> None:
        db = Database(live_server.settings.resolved_database_url)
        try:
            async with db.session() as session:  # one transaction, committed on leaving
                session.add_all(CallRecord(
                    key=f"{runs[name]}:gpu-{i}", user_id=owner_id, run_id=runs[name], request_id=f"gpu-{i}",
                    operation="forward_backward", compute_seconds=gpu, device="cuda", gpu_type="H100", gpu_count=1,
                    gpu_seconds=gpu, credits=credits, tokens_in=tokens, created_at=now - timedelta(days=ago))
                    for i, (name, ago, gpu, credits, tokens) in enumerate(GPU_CALLS))
        finally:
            await db.dispose()

    run_async(record())
    today, yesterday = now.date().isoformat(), (now - timedelta(days=1)).date().isoformat()
    page = sign_in(live_server, email).client.get("/usage?days=7").text
    # calls, compute s, GPU-s, credits, tokens trained, tokens sampled
    assert row(page, 'data-usage="total"') == ["Total", "3", "18.8", "18.8", "2.50", "150", "0", "0", "0"]
    assert row(page, f'data-day="{today}"') == [today, "2", "14.8", "14.8", "2.00", "110", "0", "0", "0"]
    assert row(page, f'data-day="{yesterday}"') == [yesterday, "1", "4.0", "4.0", "0.50", "40", "0", "0", "0"]
    assert row(page, f'data-run="{runs["a"]}"') == ["gpu a by day", "2", "16.5", "16.5", "1.75", "140", "0", "0", "0"]
    assert row(page, f'data-run="{runs["b"]}"') == ["gpu b by day", "1", "2.2", "2.2", "0.75", "10", "0", "0", "0"]
    # Per run over time: the run's "by day" link narrows every table to that run.
    link = f'/usage?days=7&run={runs["a"]}'
    assert f'href="{link}"' in page
    narrowed = sign_in(live_server, email).client.get(link).text
    assert row(narrowed, 'data-usage="total"') == ["Total", "2", "16.5", "16.5", "1.75", "140", "0", "0", "0"]
    assert row(narrowed, f'data-day="{today}"') == [today, "1", "12.5", "12.5", "1.25", "100", "0", "0", "0"]
    assert row(narrowed, f'data-day="{yesterday}"') == [yesterday, "1", "4.0", "4.0", "0.50", "40", "0", "0", "0"]
    assert f'data-run="{runs["b"]}"' not in narrowed

    usage = live_server.graphql(USAGE, {"days": 7}, key=key)["data"]["usage"]
    assert usage["total"] == {"calls": 3, "gpuSeconds": 18.75, "credits": 2.5, "tokensTrained": 150}
    assert usage["byDay"] == [{"key": today, "calls": 2, "gpuSeconds": 14.75, "credits": 2.0},
                              {"key": yesterday, "calls": 1, "gpuSeconds": 4.0, "credits": 0.5}]
    assert usage["byRun"] == [{"key": runs["a"], "calls": 2, "gpuSeconds": 16.5, "credits": 1.75},
                              {"key": runs["b"], "calls": 1, "gpuSeconds": 2.25, "credits": 0.75}]
