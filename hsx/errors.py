"""User-facing errors.

An `HsxError` carries one line that names the problem (file, row, field, flag). The CLI prints
it as `hsx: error: <line>` and exits with its `exit_code` (hsx/exitcodes.py: BAD_INPUT unless a
subclass says otherwise), without a traceback. Everything else that escapes is a bug and keeps its
traceback (exit 1, CRASHED).
"""

from hsx.exitcodes import BAD_INPUT, JOB_FAILED, STOPPED


class HsxError(Exception):
    """A problem the user can fix; its message is one line naming what is wrong."""

    exit_code = BAD_INPUT

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class JobFailed(HsxError):
    """The job ran but cannot finish (dead samples, a destination refusing uploads, the job deleted
    under its worker): JOB_FAILED, as `hsx monitor --until-done` exits; BAD_INPUT stays for input
    the user must correct before running."""

    exit_code = JOB_FAILED


class Unavailable(HsxError):
    """Something the command needs did not answer within its retries (NATS unreachable or not
    answering, JetStream electing a leader) or its --timeout passed: it stopped before its work was
    done, and running it again is safe and may succeed. STOPPED (75, sysexits' EX_TEMPFAIL)."""

    exit_code = STOPPED
