"""User-facing errors.

An `HsxError` carries one line that names the problem (file, row, field, flag). The CLI prints
it as `hsx: error: <line>` and exits non-zero, without a traceback. Everything else that escapes
is a bug and keeps its traceback.
"""


class HsxError(Exception):
    """A problem the user can fix; its message is one line naming what is wrong."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class JobFailed(HsxError):
    """The job ran but cannot finish (dead samples, a destination refusing uploads): exit 1, as
    `hsx monitor --until-done` does; 2 stays for input the user must correct before running."""

    exit_code = 1
