"""A Hugging Face `datasets` save_to_disk folder (one split), read with pyarrow alone: its data
files are Arrow IPC streams listed in `state.json`, read one record batch at a time, so the
`datasets` library is not needed at run time. Rows are numbered across the files as
`datasets.load_from_disk(folder)[i]` numbers them."""

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa

from hsx.errors import HsxError
from hsx.producer.sources.base import ArrowSource


class DatasetsFolder(ArrowSource):
    named = "a datasets save_to_disk folder"

    @classmethod
    def claims(cls, path: Path) -> bool:
        return path.is_dir()

    def files(self) -> list[Path]:
        return saved_dataset_files(self.path)

    def batches(self, columns: Callable[[list[str], str], list[str]]) -> Iterator[pa.RecordBatch]:
        for file in self.files():
            try:
                # Read, not memory-mapped: every mapped page touched would count in the process's RSS.
                reader = pa.ipc.open_stream(pa.OSFile(str(file)))
            except (pa.ArrowInvalid, OSError) as exc:
                raise HsxError(f"dataset {self.path}: {file.name} is not a readable Arrow stream ({exc})") from None
            wanted = columns(reader.schema.names, f"dataset {self.path}: {file.name}")
            for record_batch in reader:
                yield record_batch.select(wanted)


def saved_dataset_files(folder: Path) -> list[Path]:
    """The Arrow data files of a `datasets` save_to_disk folder, in row order."""
    if (folder / "dataset_dict.json").exists():
        try:
            splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        except (OSError, ValueError, AttributeError):
            splits = []
        example = f" (e.g. {folder / splits[0]})" if splits else ""
        raise HsxError(
            f"dataset {folder} is a DatasetDict with splits {', '.join(map(str, splits)) or '?'}; "
            f"give the folder of one split{example}"
        )
    state_file = folder / "state.json"
    if not state_file.exists():
        raise HsxError(
            f"dataset {folder} is a directory but not a datasets save_to_disk folder (no state.json); "
            "give a .jsonl or .parquet file or a save_to_disk folder"
        )
    try:
        state = json.loads(state_file.read_text())
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise HsxError(f"dataset {folder}: state.json does not list the data files ({exc})") from None
    files = [folder / name for name in names]
    for file in files:
        if not file.is_file():
            raise HsxError(f"dataset {folder}: data file {file.name} listed in state.json is missing")
    return files
