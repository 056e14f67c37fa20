"""Step metrics in one process (`hpctrain.observe.metrics`): the straggler check, naming the
rank the others wait for from the ranks' arrivals at the step's sync points, and on GPUs from
CUDA events (a fake of `torch.cuda.Event` here: no GPU in CI); the peak memory of each log
interval. The 2-rank runs, with the slow rank's sleep before and after its forward, are in
tests/faults/test_run_faults.py."""

from __future__ import annotations

import logging

import pytest

from hpctrain.observe.metrics import ArrivalClock, GpuForwardTimer, StragglerWatch


@pytest.fixture
def two_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks' host names without two processes."""
    monkeypatch.setattr("hpctrain.observe.metrics.all_hostnames", lambda: ["n0", "n1"])


def test_the_rank_the_others_wait_for_is_named_once_after_three_slow_logged_steps(
    caplog: pytest.LogCaptureFixture, two_hosts: None
) -> None:
    watch = StragglerWatch()
    compute = [0.01, 0.01]  # the host times before the backward: equal, they say nothing
    slow, even = [0.0, 0.06], [0.0, 0.002]  # how long rank 0 waited for each rank per step
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        fields = [
            watch.observe(compute, lateness, step_s=0.1)
            for lateness in (slow, slow, even, slow, slow, slow, slow)
        ]
    assert [f["slowest_rank"] for f in fields] == [1] * 7
    assert fields[0]["wait_for_slowest_s"] == 0.06
    warnings = [r.getMessage() for r in caplog.records if "straggler" in r.getMessage()]
    assert len(warnings) == 1, warnings  # the first two slow steps were cut by an even one
    # 60 ms of a 100 ms step: the others' work is 40 ms, the slow rank's 1.5x more
    assert warnings[0].startswith("straggler: rank 1 on n1 holds the others 60 ms per step")
    assert "(steps of 100 ms: 2.5x the others' time)" in warnings[0]


def test_before_any_arrival_no_rank_is_named_but_a_single_process_is_rank_0() -> None:
    fields = StragglerWatch().observe([0.01, 0.05])
    assert "slowest_rank" not in fields and fields["compute_time_s_worst"] == 0.05
    assert StragglerWatch().observe([0.01])["slowest_rank"] == 0


def test_arrivals_count_from_the_common_departure_and_the_first_mark() -> None:
    clock = ArrivalClock()
    clock.start_step()
    for point in ("model_call", "backward", "boundary"):
        clock.mark(point)
    assert clock.arrivals() is None  # no boundary left before this step
    clock.leave_boundary()
    clock.start_step()
    clock.mark("model_call")
    first = clock.marks["model_call"]
    clock.mark("model_call")  # a second micro-step's forward does not move it
    assert clock.marks["model_call"] == first
    clock.mark("backward")
    assert clock.arrivals() is None  # not at the boundary yet
    clock.mark("boundary")
    arrivals = clock.arrivals()
    assert arrivals is not None and 0 <= arrivals[0] <= arrivals[1] <= arrivals[2]


class FakeEvent:
    """`torch.cuda.Event` as the timer uses it: `record()` stamps the GPU's (fake) clock."""

    gpu_ms = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        self.at = FakeEvent.gpu_ms

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None, "read before both were recorded"
        return end.at - self.at


def test_gpu_forward_times_come_from_events_read_at_log_steps() -> None:
    timer = GpuForwardTimer(event_class=FakeEvent)
    for forward_ms in (30.0, 50.0):
        timer.forward_starts()
        timer.forward_starts()  # a second micro-step's forward: the first one's event counts
        FakeEvent.gpu_ms += forward_ms
        timer.backward_starts()
        FakeEvent.gpu_ms += 100.0  # the backward and the optimizer: not counted
    assert timer.read() == (pytest.approx(0.08), 2)
    assert timer.read() == (0.0, 0)  # read once


def test_a_slow_gpu_is_named_from_its_forward_time(
    caplog: pytest.LogCaptureFixture, two_hosts: None
) -> None:
    """A throttled GPU: the hosts (which only launch kernels) arrive together."""
    watch = StragglerWatch()
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        for _ in range(3):
            fields = watch.observe([0.01, 0.01], [0.0, 0.0], step_s=0.1, gpu_forward_s=[0.03, 0.08])
    assert fields["slowest_gpu_rank"] == 1 and fields["gpu_forward_s_worst"] == 0.08
    warnings = [r.getMessage() for r in caplog.records if "straggler" in r.getMessage()]
    assert warnings == [
        "straggler: rank 1 on n1 runs its forward on its GPU in 80 ms, 2.7x the other "
        "ranks' median of 30 ms, for 3 logged steps in a row"
    ]


def test_peak_memory_is_the_log_interval_s_on_cpu() -> None:
    import torch

    from hpctrain.observe.metrics import peak_memory_mb

    cpu = torch.device("cpu")
    peak_memory_mb(cpu)  # the interval starts here
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    del big
    first = peak_memory_mb(cpu)
    second = peak_memory_mb(cpu)  # an interval without it
    assert first - second >= 48, (first, second)


def test_peak_memory_is_reset_per_interval_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake of torch.cuda's peak counter (no GPU in CI)."""
    import torch

    from hpctrain.observe.metrics import peak_memory_mb

    peak = {"bytes": 3 * 2**30}

    def reset(device: object) -> None:
        peak["bytes"] = 2**30  # what is allocated now

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: peak["bytes"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    cuda = torch.device("cuda", 0)
    assert peak_memory_mb(cuda) == 3 * 1024
    assert peak_memory_mb(cuda) == 1024
