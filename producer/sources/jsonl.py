"""JSONL (`.jsonl`, `.json`, `.ndjson`): one JSON object per line, UTF-8, read line by line."""

from collections.abc import Iterator

from hsx.producer.sources.base import LineSource


class JsonlSource(LineSource):
    suffixes = (".jsonl", ".json", ".ndjson")
    named = ".jsonl"

    def lines(self) -> Iterator[bytes]:
        with open(self.path, "rb") as f:
            yield from f
