"""A bad row (`BadRow`): a row that cannot be a sample of the job, named by where it is; and what
a reading loop does with one (`OnBadRow`, `set_aside`). Whether it stops the job is
--on-bad-row's (producer/inputs.py `BadRows`)."""

from collections.abc import Callable

from hsx.errors import HsxError


class BadRow(HsxError):
    """A row that cannot be a sample of the job: where it is (file:line, or the row index of a
    Parquet file or a datasets folder), the row's id if it has one, and why. Raised wherever a
    row is found bad (reading, checking, rendering its conversation); --on-bad-row decides whether
    it stops the job or is set aside and reported."""

    def __init__(self, where: str, reason: str, *, source_id: str | None = None) -> None:
        super().__init__(f"{where}: {reason}")
        self.where, self.reason, self.source_id = where, " ".join(reason.split()), source_id


# What a reading loop does with a bad row: None raises it (the first bad row stops the reading);
# otherwise called with it (--on-bad-row: it raises to stop, or records the row and reading goes on).
OnBadRow = Callable[[BadRow], None] | None


def set_aside(bad: BadRow, on_bad_row: OnBadRow) -> None:
    if on_bad_row is None:
        raise bad
    on_bad_row(bad)
