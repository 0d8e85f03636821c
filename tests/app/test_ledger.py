"""What a call costs, by the device its run trains on (docs/BILLING.md's worked example, in numbers)."""

from __future__ import annotations

import pytest

from app.services.ledger import Charge, Rates, charge, gpu_seconds
from app.tables import Run

RATES = Rates(gpu_second=2.5, cpu_second=0.5)


def run_on(device: str, gpu_config: str, compute_seconds: float = 0.0) -> Run:
    return Run(id="r", user_id="u", base_model="m", lora_config={}, optimizer_config={}, gpu_config=gpu_config,
               device=device, compute_seconds=compute_seconds)


@pytest.mark.parametrize(("device", "gpu_config", "expected"), [
    ("cpu", "L40S:1", Charge("cpu", "cpu", 0, 0.0, 0.2)),  # asked for an L40S, trained on the CPU: the CPU rate
    ("cuda:0", "L40S:1", Charge("cuda:0", "L40S", 1, 0.4, 1.0)),
    ("cuda:0", "A100-80GB:2", Charge("cuda:0", "A100-80GB", 2, 0.8, 2.0)),
    ("", "L40S:1", Charge("", "L40S", 1, 0.4, 1.0)),  # a run older than the device column: as it was billed then
])
def test_a_call_is_charged_by_the_device_its_run_trains_on(device: str, gpu_config: str, expected: Charge) -> None:
    owed = charge(run_on(device, gpu_config), 0.4, RATES)
    assert (owed.device, owed.gpu_type, owed.gpu_count) == (expected.device, expected.gpu_type, expected.gpu_count)
    assert (owed.gpu_seconds, owed.credits) == pytest.approx((expected.gpu_seconds, expected.credits))


def test_a_cpu_run_is_free_at_the_default_cpu_rate() -> None:
    run = run_on("cpu", "L40S:1", compute_seconds=3.0)
    assert charge(run, run.compute_seconds, Rates(gpu_second=1.0, cpu_second=0.0)).credits == 0.0
    assert gpu_seconds(run) == 0.0 and gpu_seconds(run_on("cuda:0", "L40S:4", 3.0)) == 12.0


def test_negative_seconds_cost_nothing() -> None:
    assert charge(run_on("cuda:0", "L40S:1"), -1.0, RATES).credits == 0.0
