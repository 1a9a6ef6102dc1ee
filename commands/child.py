"""A service started by `hsx up` with its config built by up: `python -m hsx.commands.child`
reads one msgspec JSON object from stdin, `{"command": "consume", "config": {...}}`, and runs that
service. up resolved the config once (flags, environment, job file, defaults) with the same
builders as the command itself (commands/services.py); the child parses nothing again, and
its secrets (a NATS password) travel in the pipe, not in argv or the environment.
"""

import signal
import sys

# up passes Ctrl-C on as SIGINT: until the service installs its own handlers (it stops cleanly
# then), SIGINT ends the process as SIGTERM would, not with a KeyboardInterrupt traceback.
signal.signal(signal.SIGINT, signal.SIG_DFL)

from pathlib import Path  # noqa: E402

import msgspec  # noqa: E402

from hsx.commands.services import COMMANDS, ServiceConfig, in_this_process, run_service  # noqa: E402
from hsx.errors import HsxError  # noqa: E402
from hsx.exitcodes import STOPPED  # noqa: E402
from hsx.logs import configure_logging  # noqa: E402


class ChildOrder(msgspec.Struct, frozen=True, kw_only=True):
    command: str  # produce, consume, upload or monitor
    log_level: str
    config: msgspec.Raw


def _encode_path(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    raise NotImplementedError(type(value))


def _decode_path(kind: type, value: object) -> object:
    if kind is Path:
        return Path(value)
    raise NotImplementedError(kind)


def order(cfg: ServiceConfig, *, log_level: str) -> bytes:
    """What `hsx up` writes to a child's stdin."""
    config = msgspec.Raw(msgspec.json.encode(cfg, enc_hook=_encode_path))
    return msgspec.json.encode(ChildOrder(command=COMMANDS[type(cfg)], log_level=log_level, config=config))


def read_order(data: bytes) -> tuple[ServiceConfig, str]:
    received = msgspec.json.decode(data, type=ChildOrder)
    kind = {command: cls for cls, command in COMMANDS.items()}[received.command]
    return msgspec.json.decode(received.config, type=kind, dec_hook=_decode_path), received.log_level


def main() -> int:
    cfg, log_level = read_order(sys.stdin.buffer.read())
    configure_logging(level=log_level)
    try:
        return run_service(in_this_process(cfg))
    except HsxError as exc:
        print(f"hsx: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return STOPPED


if __name__ == "__main__":
    sys.exit(main())
