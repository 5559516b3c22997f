"""``--disaggregation-*`` and SGLang's disaggregation environment variables, decided once here."""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass

MODES = ("null", "prefill", "decode")
BACKENDS = ("jax-transfer",)  # serve/disaggregation/transfer.py


class KVPoll(enum.IntEnum):
    """A bootstrap room's state (SGLang's numbering)."""
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


def count_states(states) -> dict[str, int]:
    """How many rooms are in each state, by its name (for ``/server_info``)."""
    out: dict[str, int] = {}
    for state in states:
        out[state.name] = out.get(state.name, 0) + 1
    return out


def _env(name: str, default: float, least: float) -> float:
    value = os.environ.get(name)
    try:
        return max(float(value), least) if value is not None else default
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds or a count, got {value!r}") from None


@dataclass(frozen=True)
class DisaggregationConfig:
    mode: str = "null"
    bootstrap_port: int = 8998
    transfer_backend: str = "jax-transfer"
    bootstrap_timeout: float = 300.0  # SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT: D must register by then
    waiting_timeout: float = 300.0  # SGLANG_DISAGGREGATION_WAITING_TIMEOUT: D gives up on P's state
    heartbeat_interval: float = 5.0  # SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL
    heartbeat_max_failure: int = 2  # SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE
    poll_interval: float = 0.005  # how often each side looks at a room

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"--disaggregation-mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.transfer_backend not in BACKENDS:
            raise ValueError(f"--disaggregation-transfer-backend must be one of {', '.join(BACKENDS)}, "
                             f"not {self.transfer_backend!r}")
        if not 0 < self.bootstrap_port < 65536:
            raise ValueError(f"--disaggregation-bootstrap-port must be a TCP port, got {self.bootstrap_port}")

    @classmethod
    def from_env(cls, mode: str, bootstrap_port: int, transfer_backend: str) -> "DisaggregationConfig":
        return cls(mode, bootstrap_port, transfer_backend,
                   _env("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0, 0.1),
                   _env("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0, 0.1),
                   _env("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", 5.0, 0.1),
                   int(_env("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", 2, 1)))

    @property
    def heartbeat_timeout(self) -> float:
        """No contact for this long: the other side is gone."""
        return self.heartbeat_interval * self.heartbeat_max_failure
