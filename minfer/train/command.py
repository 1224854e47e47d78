"""``minfer train``: train a tokenizer and a small Llama, export an HF checkpoint folder.

``minfer.cli`` calls ``add_train_parser(subparsers)`` and dispatches to ``run_train``;
``python -m minfer.train.command ...`` runs the same command standalone. The trainer (torch) is
imported when the command runs, not when its flags are built.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from minfer.config import DTYPE_NAMES
from minfer.train.config import HELDOUT_RULES, TrainConfig

_DEFAULTS = TrainConfig(out=Path("runs/train"))


def _add_arguments(p: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    p.add_argument("paths", nargs="*",
                   help="text files or folders (default: this interpreter's stdlib *.py)")
    p.add_argument("--out", type=Path, default=d.out,
                   help="output folder: HF checkpoint + train/ state (default: %(default)s)")
    p.add_argument("--heldout", choices=HELDOUT_RULES, default=d.heldout,
                   help="held-out documents: packages (the stdlib's email, json, tomllib and their tests), tail "
                        "(the last ~5%% of the text), auto (packages for the default stdlib corpus, tail for "
                        "yours; default)")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="reuse the tokenizer.json in this folder instead of training one")
    shape = p.add_argument_group("model shape")
    shape.add_argument("--hidden-size", type=int, default=d.hidden_size)
    shape.add_argument("--layers", type=int, default=d.layers)
    shape.add_argument("--heads", type=int, default=d.heads)
    shape.add_argument("--kv-heads", type=int, default=d.kv_heads)
    shape.add_argument("--intermediate-size", type=int, default=d.intermediate_size)
    shape.add_argument("--rope-theta", type=float, default=d.rope_theta)
    shape.add_argument("--dropout", type=float, default=d.dropout,
                       help="residual dropout while training (default: %(default)s)")
    opt = p.add_argument_group("optimisation")
    opt.add_argument("--seq-len", type=int, default=d.seq_len)
    opt.add_argument("--batch-size", type=int, default=d.batch_size)
    opt.add_argument("--steps", type=int, default=d.steps)
    opt.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    opt.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    opt.add_argument("--warmup", type=int, default=d.warmup,
                     help="warm-up steps (default: the first 10%% of the run: of --steps, or of --max-time when "
                          "that ends the run first)")
    opt.add_argument("--weight-decay", type=float, default=d.weight_decay)
    opt.add_argument("--grad-clip", type=float, default=d.grad_clip)
    opt.add_argument("--eval-every", type=int, default=d.eval_every)
    opt.add_argument("--eval-windows", type=int, default=d.eval_windows,
                     help="windows of held-out text per periodic evaluation")
    opt.add_argument("--max-time", type=float, default=None,
                     help="stop after this many seconds; the lr schedule ends with it")
    run = p.add_argument_group("run")
    run.add_argument("--device", default=d.device, help="auto, cpu, cuda, cuda:1, ...")
    run.add_argument("--seed", type=int, default=d.seed)
    run.add_argument("--resume", action="store_true",
                     help="continue from OUT/train/checkpoint.pt")
    run.add_argument("--dtype", default=d.dtype, choices=DTYPE_NAMES,
                     help="dtype of the exported weights")
    run.add_argument("--compile", action="store_true", help="torch.compile the model")
    run.add_argument("--stop-after", type=int, default=None,
                     help="pause after this step (resume later with --resume)")
    run.add_argument("--quiet", action="store_true")


def add_train_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``train`` subcommand; its handler is ``run_train`` (set as ``func``)."""
    p = subparsers.add_parser("train", help="train a tokenizer + small Llama, export HF",
                              description=__doc__.splitlines()[0] + " On a CPU the default shape takes about 40 s "
                              "a step on 2 cores: for a quick run try --hidden-size 128 --layers 4 --seq-len 256 "
                              "--batch-size 8 --vocab-size 2048 --steps 200.")
    _add_arguments(p)
    p.set_defaults(func=run_train)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Every TrainConfig field has a flag of the same name."""
    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}
    return TrainConfig(**(values | {"paths": [str(x) for x in args.paths]}))


def run_train(args: argparse.Namespace) -> int:
    """Run ``minfer train``; a bad argument or corpus prints one line and returns 2."""
    from minfer.train.trainer import train

    try:
        metrics = train(config_from_args(args))
    except ValueError as exc:
        print(f"minfer train: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(metrics, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minfer.train.command",
                                     description=__doc__.splitlines()[0])
    _add_arguments(parser)
    return run_train(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
