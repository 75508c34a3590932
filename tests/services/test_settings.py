"""Settings per service: the same environment variables as when every process read them all,
each read by the service that uses it; a moved knob handed to the shared Settings is an error."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.agent.settings import AgentSettings
from services.api.settings import ApiSettings
from services.common.settings import Settings, as_env
from services.notifier.settings import NotifierSettings
from services.tracker.settings import TrackerSettings
from services.validator.settings import CPU_FAKE, ValidatorSettings, for_cpu_fake


def test_each_service_reads_its_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"GREYHOUND_VALIDATOR_GEMM_N": "512", "GREYHOUND_VALIDATOR_P2P_BYTES": "[1024, 2048]",
           "GREYHOUND_VALIDATOR_THRESHOLD": "0.3", "GREYHOUND_VALIDATOR_PAUSE_TIMEOUT_S": "4",
           "GREYHOUND_HANG_FLOOR_S": "7.5", "GREYHOUND_HANG_MULTIPLE": "9",
           "GREYHOUND_DETECTOR": "window", "GREYHOUND_AGENT_POLL_S": "0.2",
           "GREYHOUND_AGENT_COUNTERS_S": "2", "GREYHOUND_DATA_DIR": "/tmp/gh",
           "GREYHOUND_API_PORT": "9123", "GREYHOUND_API_ANONYMOUS_ROLE": "viewer",
           "GREYHOUND_FLEET_DRAIN_JOBS": "4", "GREYHOUND_WEBHOOK_MAX_ATTEMPTS": "3",
           "GREYHOUND_NOTIFIER_POLL_S": "0.25", "GREYHOUND_WEBHOOK_TIMEOUT_S": "7"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    val = ValidatorSettings()
    assert (val.gemm_n, val.p2p_bytes, val.threshold, val.pause_timeout_s) == (512, [1024, 2048], 0.3, 4.0)
    t = TrackerSettings()
    assert (t.detector, t.hang_floor_s, t.hang_multiple) == ("window", 7.5, 9.0)
    a = AgentSettings()
    assert (a.poll_s, a.counters_s) == (0.2, 2.0)
    api = ApiSettings()
    assert (api.api_port, api.api_anonymous_role, api.fleet_drain_jobs) == (9123, "viewer", 4)
    n = NotifierSettings()
    assert (n.webhook_max_attempts, n.notifier_poll_s) == (3, 0.25)
    shared = Settings()  # the others' variables do not disturb it
    assert (str(shared.data_dir), shared.webhook_timeout_s) == ("/tmp/gh", 7.0)


@pytest.mark.parametrize("moved", ["validator_gemm_n", "hang_floor_s", "agent_poll_s", "detector",
                                   "api_port", "api_anonymous_role", "fleet_window_days",
                                   "webhook_max_attempts", "notifier_poll_s"])
def test_the_shared_settings_refuse_a_moved_knob(moved: str) -> None:
    with pytest.raises(ValidationError, match=moved):
        Settings(**{moved: 1})


def test_bad_values_fail_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GREYHOUND_DETECTOR", "magic")
    with pytest.raises(ValidationError, match="detector"):
        TrackerSettings()
    with pytest.raises(ValidationError):
        ValidatorSettings(gemm_repeat=0)


def test_as_env_rebuilds_the_settings_in_a_child(monkeypatch: pytest.MonkeyPatch) -> None:
    made = ValidatorSettings(gemm_n=128, p2p_bytes=[1, 2, 3])
    for k, v in as_env(made).items():
        assert k.startswith("GREYHOUND_VALIDATOR_")
        monkeypatch.setenv(k, v)
    assert ValidatorSettings() == made


class _WithSecret(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GREYHOUND_TEST_", extra="forbid")

    key: SecretStr | None = None
    sizes: list[int] = [1]
    flag: bool = False
    where: Path = Path("x")


def test_as_env_passes_secrets_flags_and_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _WithSecret(key=SecretStr("s3cret"), sizes=[4, 5], flag=True, where=Path("/a b"))
    env = as_env(made)
    assert env["GREYHOUND_TEST_KEY"] == "s3cret"
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert _WithSecret() == made
    assert "GREYHOUND_TEST_KEY" not in as_env(_WithSecret(key=None))


def test_cpu_fake_sizes_yield_to_what_the_operator_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    assert for_cpu_fake().gemm_n == CPU_FAKE["gemm_n"] != ValidatorSettings().gemm_n
    monkeypatch.setenv("GREYHOUND_VALIDATOR_GEMM_N", "1000")
    fake = for_cpu_fake()
    assert fake.gemm_n == 1000 and fake.threshold == CPU_FAKE["threshold"]
