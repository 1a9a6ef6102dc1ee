"""hsx: durable, resumable hidden-state extraction over NATS JetStream.

The shared core: wire schemas, JetStream topology, settings helpers, logging, output layout,
destinations and the `hsx` command line. Each service lives in its own top-level package
(`producer`, `gpu_consumer`, `uploader`, `monitor`).
"""

__version__ = "0.1.0"
