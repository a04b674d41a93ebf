"""The options that connect() and the job calls take as keywords, and how they are checked."""

import datetime
import os
from typing import Any, Dict, Iterable, Mapping, Optional, Union

from .errors import InvalidArgumentError

Duration = Union[float, int, datetime.timedelta]

# ClientOptions fields (include/modelavg/client/client.h) that connect() takes as keywords, with their kinds.
_CLIENT_OPTIONS = {
    "worker_id": str, "auth_token": str, "tls": bool, "tls_ca_file": str, "tls_cert_file": str,
    "tls_key_file": str, "join_timeout": Duration, "rpc_timeout": Duration,
    "heartbeat_interval": Duration, "heartbeat_stream": bool, "share_heartbeat_stream": bool,
    "heartbeat_relay_dir": str, "collective_timeout": Duration, "leave_timeout": Duration,
    "coordinator_outage_timeout": Duration,
    "schedule_window": int, "gloo_hostname": str, "gloo_in_place": bool,
}
# What the job-management calls take besides the coordinator's address.
_CONNECTION_OPTIONS = ("auth_token", "tls", "tls_ca_file", "tls_cert_file", "tls_key_file",
                       "rpc_timeout")


def _invalid(message: str) -> InvalidArgumentError:
    return InvalidArgumentError("INVALID_ARGUMENT", message)


def _seconds(name: str, value: Duration) -> float:
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise _invalid(f"{name}={value!r}: expected a positive number of seconds or a timedelta")
    return float(value)


def _options(options: Mapping[str, Any], allowed: Iterable[str]) -> Dict[str, Any]:
    allowed = set(allowed)
    out: Dict[str, Any] = {}
    for name, value in options.items():
        if name not in allowed:
            raise TypeError(f"unknown option {name!r}; the options are: "
                            f"{', '.join(sorted(allowed))}")
        if value is None:
            continue
        kind = _CLIENT_OPTIONS[name]
        if kind is Duration:
            value = _seconds(name, value)
        elif kind is bool:
            if not isinstance(value, bool):
                raise _invalid(f"{name}={value!r}: expected True or False")
        elif kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise _invalid(f"{name}={value!r}: expected an int")
        elif not isinstance(value, str):
            raise _invalid(f"{name}={value!r}: expected a string")
        out[name] = value
    return out


def _coordinator(coordinator: Optional[str]) -> str:
    coordinator = coordinator or os.environ.get("MODELAVG_COORDINATOR")
    if not coordinator:
        raise _invalid("no coordinator: pass coordinator='host:port' or set "
                       "MODELAVG_COORDINATOR")
    return coordinator


def _env_int(name: str) -> Optional[int]:
    text = os.environ.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise _invalid(f"environment variable {name}={text!r} is not an integer") from None


def _backup_on_host(backup_device: Any) -> bool:
    """torchft's ``backup_device`` for an averager's outer state (docs/diloco.md): None keeps the
    anchors and momenta on the parameters' device; ``"cpu"`` (or ``torch.device("cpu")``) keeps
    those of CUDA parameters in pinned host memory. Host parameters keep theirs in host memory
    either way."""
    if backup_device is None:
        return False
    if str(backup_device) == "cpu":
        return True
    raise ValueError(f"backup_device must be None (the parameters' device) or 'cpu' (pinned host "
                     f"memory), not {backup_device!r}")


def _conn(coordinator: Optional[str], options: Mapping[str, Any]) -> Dict[str, Any]:
    conn = _options(options, _CONNECTION_OPTIONS)
    conn["coordinator"] = _coordinator(coordinator)
    return conn
