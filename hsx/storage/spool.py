"""A node's spool: the local directory where finished sample files wait for upload."""

import os
from pathlib import Path


def spool_usage(spool: Path, job: str) -> tuple[int, int]:
    """(files, bytes) of the job's finished files in the spool; temp files excluded."""
    files = total = 0
    stack = [spool / job]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except FileNotFoundError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                stack.append(Path(entry.path))
            elif entry.name.endswith(".safetensors") and not entry.name.startswith("."):
                try:
                    total += entry.stat(follow_symlinks=False).st_size
                    files += 1
                except FileNotFoundError:
                    pass
    return files, total
