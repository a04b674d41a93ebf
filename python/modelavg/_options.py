"""The options that connect() and the job calls take as keywords, and how they are checked.

The table of options is the binding's (``_core.OPTIONS``, made from the same rows that copy them
into the C++ ``ClientOptions``), and the environment (``MODELAVG_COORDINATOR``,
``MODELAVG_AUTH_TOKEN_FILE``, ``MODELAVG_TLS_CA_FILE``, ...) is read by the C++ parser that every
modelavg program uses (``_core.connection_from_environment``): nothing is written twice here.
"""

import datetime
import os
from typing import Any, Dict, Iterable, Mapping, Optional, Union

from . import _core
from .errors import InvalidArgumentError

Duration = Union[float, int, datetime.timedelta]

_KINDS = {"str": str, "bool": bool, "int": int, "float": float, "duration": Duration}
# ClientOptions fields (include/modelavg/client/client.h) that connect() takes as keywords, with
# their kinds.
_CLIENT_OPTIONS = {name: _KINDS[kind] for name, (kind, _) in _core.OPTIONS.items()}
# What the job-management calls take besides the coordinator's address (ConnectionOptions).
_CONNECTION_OPTIONS = tuple(name for name, (_, connection) in _core.OPTIONS.items() if connection)
_TOKEN_OPTIONS = ("auth_token", "auth_token_file")


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
        elif kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _invalid(f"{name}={value!r}: expected a number")
            value = float(value)
        elif not isinstance(value, str):
            raise _invalid(f"{name}={value!r}: expected a string")
        out[name] = value
    return out


def _with_environment(opts: Dict[str, Any]) -> Dict[str, Any]:
    """`opts` (keywords already checked) completed from the environment: what a keyword gives
    stays; the token comes from the keywords or from the environment, never both."""
    env = _core.connection_from_environment()
    token_given = any(name in opts for name in _TOKEN_OPTIONS)
    for name, value in env.items():
        if name in _TOKEN_OPTIONS and token_given:
            continue
        opts.setdefault(name, value)
    return opts


def _coordinator(coordinator: Optional[str]) -> str:
    coordinator = coordinator or _core.connection_from_environment().get("coordinator")
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
    return _with_environment(conn)
