"""hsx: durable, resumable hidden-state extraction over NATS JetStream.

The core, in rooms (docs/architecture/index.md, "Layout"): `hsx.wire` (messages, topology, progress),
`hsx.storage` (the output format, destinations, index, the trainers' reader), `hsx.model`
(layers, model configs, devices) and `hsx.config` (where settings come from), over the base
modules (`hsx.job`: the job's own types; `hsx.errors`, `hsx.logs`, ...). The services
`hsx.producer`, `hsx.gpu_consumer`, `hsx.uploader`, `hsx.monitor` and the command line
`hsx.commands` are installed under this namespace from the top-level folders of those names.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("hsx-extract")  # the distribution (pyproject.toml), where the version is written
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
