"""What GPU health says about an incident: throttled or low-clocked stragglers against their peers,
Xid / ECC / NVLink errors behind hangs, in findings and in words; nothing said without cause."""

from __future__ import annotations

from typing import Any

from greyhound.core.gpu_health import (
    MAX_SAMPLES,
    evidence,
    explain_hang,
    explain_slow,
    explanation,
)


def gpu(index: int, *, host: str = "node-2", sm: int | None = 1980, throttle: list[str] | None = None,
        temp: int | None = 60, xids: list[dict[str, Any]] | None = None, ecc: int | None = 0,
        nvlink: dict[str, int] | None = None) -> dict[str, Any]:
    return {"index": index, "host": host, "ranks": [index], "sm_clock_mhz": sm,
            "throttle": throttle or [], "temperature_c": temp, "power_w": 450.0,
            "ecc_uncorrected": ecc, "nvlink_errors": nvlink, "xids": xids or []}


def test_thermally_throttled_straggler_is_said_in_words() -> None:
    samples = [gpu(0), gpu(1), gpu(2), gpu(3, sm=1095, throttle=["sw_thermal", "hw_thermal"], temp=87)]
    found = explain_slow(samples, [3])
    assert [(f.kind, f.index, f.ranks) for f in found] == [("throttled", 3, [3])]
    assert found[0].words == ("GPU 3 on node-2 (rank 3) is thermally throttled "
                              "(SM clock 1095 MHz vs 1980 MHz on its peers; 87 C; 450 W)")
    assert explanation(found) == found[0].words


def test_low_clock_without_a_reason_still_explains() -> None:
    found = explain_slow([gpu(0), gpu(1, sm=1200), gpu(2)], [1])
    assert [f.kind for f in found] == ["low_clock"]
    assert "running at a low clock (SM clock 1200 MHz vs 1980 MHz" in found[0].words


def test_healthy_straggler_and_harmless_reasons_say_nothing() -> None:
    samples = [gpu(0), gpu(1, throttle=["gpu_idle", "sync_boost"]), gpu(2, sm=1800)]
    assert explain_slow(samples, [1]) == []
    assert explain_slow(samples, [2]) == []  # 1800 / 1980 is within the peers' spread
    assert explain_slow(samples, [7]) == []  # no sample for the suspect
    assert explanation([]) is None


def test_power_cap_with_no_peers_reports_its_clock_alone() -> None:
    found = explain_slow([gpu(0, sm=1410, throttle=["sw_power_cap"])], [0])
    assert found[0].words.startswith("GPU 0 on node-2 (rank 0) is power-capped (SM clock 1410 MHz;")


def test_xid_behind_a_hang_on_the_hung_rank_first() -> None:
    samples = [gpu(0, xids=[{"code": 13, "ts": 90.0}]), gpu(1, xids=[{"code": 79, "ts": 97.0}]),
               gpu(2)]
    found = explain_hang(samples, [1], now_s=100.0)
    assert [(f.kind, f.index) for f in found] == [("xid", 1)]
    assert found[0].words == ("GPU 1 on node-2 (rank 1) reported Xid 79 (GPU has fallen off the "
                              "bus), 3 s before the incident")
    # the hang names rank 2, whose GPU is fine: the GPUs that did report errors explain it
    assert [f.index for f in explain_hang(samples, [2], now_s=100.0)] == [0, 1]


def test_ecc_and_nvlink_errors_explain_a_hang_and_clean_gpus_do_not() -> None:
    samples = [gpu(0, ecc=3), gpu(1, nvlink={"crc_flit": 7, "replay": 0}), gpu(2)]
    words = [f.words for f in explain_hang(samples, [0, 1])]
    assert words == ["GPU 0 on node-2 (rank 0) reported 3 uncorrectable ECC error(s)",
                     "GPU 1 on node-2 (rank 1) reported NVLink errors (crc_flit 7)"]
    assert explain_hang([gpu(0), gpu(1, ecc=None, nvlink=None)], [0, 1]) == []


def test_evidence_is_bounded_and_puts_the_findings_first() -> None:
    samples = [gpu(i) for i in range(40)] + [gpu(40, sm=1000, throttle=["hw_slowdown"])]
    found = explain_slow(samples, [40])
    ev = evidence(samples, found)
    assert len(ev["samples"]) == MAX_SAMPLES and ev["samples"][0]["index"] == 40
    assert ev["gpus_sampled"] == 41 and ev["peer_sm_clock_mhz"] == 1980
    assert ev["findings"][0]["words"].endswith("is in hardware slowdown (SM clock 1000 MHz vs "
                                               "1980 MHz on its peers; 60 C; 450 W)")
