"""Parquet (`.parquet`, `.pq`), read one record batch of the needed columns at a time."""

from collections.abc import Callable, Iterator

import pyarrow as pa

from hsx.errors import HsxError
from hsx.producer.sources.base import ROWS_PER_READ, ArrowSource


class ParquetSource(ArrowSource):
    suffixes = (".parquet", ".pq")
    named = ".parquet"

    def batches(self, columns: Callable[[list[str], str], list[str]]) -> Iterator[pa.RecordBatch]:
        import pyarrow.parquet as pq

        try:
            # No pre-buffering: it keeps every column chunk read so far (memory growing with the file).
            parquet = pq.ParquetFile(self.path, pre_buffer=False, buffer_size=1 << 20)
        except Exception as exc:  # pyarrow raises several types for a file that is not Parquet
            raise HsxError(f"{self.path}: not a readable Parquet file ({exc})") from None
        wanted = columns(parquet.schema_arrow.names, str(self.path))
        yield from parquet.iter_batches(columns=wanted, batch_size=ROWS_PER_READ)
