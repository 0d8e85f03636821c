"""Whose rows a decode pass takes, and which prompts prefill first, when several users decode on one base (issue 34
#10): plain data in, plain data out, no torch.

A pass's cost grows with its rows where the device is compute-bound (the CPU: one row 0.3 s, 16 rows 0.6 s, 129 rows
6.7 s a step for SmolLM2-135M on one thread), so a user with one row beside another's 128 would wait out 128 rows'
passes. While more than one user has rows running, a pass takes at most `cap` rows: each user an equal share
(water-filled: a user needing less leaves the rest to the others), and within a user its rows least recently decoded
first, so every row advances in turn. A row skipped by a pass keeps its place (its draws are counter-based on its
position, so it samples what it would have). One user alone, or no cap (CUDA, where rows ride a pass almost free), keeps
the whole batch in every pass. Prompts waiting to prefill go the user with the fewest rows running first, and while
several users decode under a cap, a user with its share of a pass running prefills no more (its prefill would lengthen
the others' passes for rows that would sit out passes anyway).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

CPU_FAIR_PASS_ROWS = 16  # rows of a CPU decode pass while several users decode (None on CUDA: see fair_pass_rows)
# A user whose rows ended counts as decoding this many steps more: a loop's next call (sent as the last one is answered,
# tens of ms later) finds capped passes, not an uncapped one of the other user's rows that it would wait out first.
FAIR_GRACE_STEPS = 2


def fair_pass_rows(device_type: str) -> int | None:
    """The cap for a device: on CUDA a decode pass is bound by reading the weights, not by its rows, so none."""
    return None if device_type == "cuda" else CPU_FAIR_PASS_ROWS


class Row(NamedTuple):
    owner: str  # the user whose call the row samples for
    turn: int  # when it was last decoded, a number that grows with every row decoded (0: never)
    slot: int


def uncapped(cap: int | None, rows: int) -> bool:
    """Whether a pass of `rows` running rows takes them all whoever owns them (then least recently decoded first)."""
    return cap is None or rows <= cap


def decode_turn(rows: Sequence[Row], cap: int | None, waiting: Collection[str] = ()) -> list[int]:
    """The slots of `rows` that this pass decodes, least recently decoded first (the order to number their turns in,
    so that rows decoded together keep their order for the next choice). `waiting`: owners of prompts waiting to
    prefill, whose first token the pass delays as much as a running row's next, and of rows just ended
    (FAIR_GRACE_STEPS), whose next call the pass would delay."""
    by_owner: dict[str, list[Row]] = {}
    for row in rows:
        by_owner.setdefault(row.owner, []).append(row)
    if uncapped(cap, len(rows)) or len(set(by_owner) | set(waiting)) < 2:
        return [row.slot for row in sorted(rows, key=lambda r: (r.turn, r.slot))]
    assert cap is not None  # uncapped() holds for None
    chosen: list[Row] = []
    left = max(cap, len(by_owner))  # each user at least one row: none waits a whole round
    owners = sorted(by_owner.values(), key=len)
    for i, own in enumerate(owners):
        share = max(left // (len(owners) - i), 1)
        take = sorted(own, key=lambda r: (r.turn, r.slot))[:share]
        chosen += take
        left -= len(take)
    return [row.slot for row in sorted(chosen, key=lambda r: (r.turn, r.slot))]


def prefill_order(waiting: Sequence[tuple[str, bool, int]], running: dict[str, int],
                  cap: int | None = None, others: Collection[str] = ()) -> list[int]:
    """Indices of the waiting prompts (owner, started, rows) in the order they prefill: those already begun first
    (their slots are held), then by their owner's rows running and queued ahead of them, fewest first; ties by
    arrival. With a `cap` and several users, a prompt not begun whose owner already has a pass's share of rows
    (running and queued ahead) is left out: those rows would sit out passes anyway, and its prefill would lengthen
    every pass the other users' rows ride in (a 64-token prefill doubled a 16-row CPU step). `others`: users with no
    row running who count all the same (FAIR_GRACE_STEPS)."""
    owners = {owner for owner, rows in running.items() if rows} | {owner for owner, _, _ in waiting} | set(others)
    share = max(cap // len(owners), 1) if cap is not None and len(owners) > 1 else None
    counted = dict(running)
    keyed: list[tuple[int, int, int]] = []
    for i, (owner, started, rows) in enumerate(waiting):
        ahead = counted.get(owner, 0)
        counted[owner] = ahead + rows
        if started or share is None or ahead < share:
            keyed.append((0 if started else 1, ahead, i))
    return [i for _, _, i in sorted(keyed)]
