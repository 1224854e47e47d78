"""The training loop: packed windows, AdamW, warmup + cosine, periodic validation, resume.

Layout of an output folder (``--out``)::

    config.json, model.safetensors, generation_config.json, tokenizer*.json   HF checkpoint
    train/checkpoint.pt    model + optimizer + step + clock, rewritten at every evaluation
    train/best.pt          weights with the lowest validation loss so far (what is exported)
    train/log.jsonl        one line per evaluation
    train/metrics.json     final numbers (the sweep's table reads these)

The learning-rate schedule runs on *progress*, the larger of ``step / steps`` and
``elapsed / max_time``: a time-boxed run (``--max-time``) then ends its cosine decay exactly
when its time runs out, which is what a fixed device budget needs. Warm-up is the first 10% of
progress unless ``--warmup`` fixes a step count, so it scales with the budget too: a fixed count
can outlast a short or time-boxed run, which then never leaves warm-up.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from minfer.config import torch_dtype
from minfer.train.config import WARMUP_FRACTION, TrainConfig
from minfer.train.corpus import load_corpus, texts
from minfer.train.export import export_hf, hf_checkpoint_bytes
from minfer.train.model import Llama
from minfer.train.tokenizer import (PAD_ID, check_vocab_size, encode_documents, load_tokenizer, save_tokenizer,
                                    train_tokenizer)


def resolve_device(name: str) -> torch.device:
    """'auto', 'cpu', 'cuda' or 'cuda:N', checked here so that a bad name is a clear error, not a
    failure deep inside the first tensor op."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return device


def lr_at(cfg: TrainConfig, step: int, progress: float) -> float:
    """The learning rate of ``step``, at ``progress`` (the larger of ``step / steps`` and ``elapsed / max_time``):
    a linear warm-up over ``cfg.warmup`` steps, or when that is None over the first WARMUP_FRACTION of progress
    (so it scales with a time budget as the decay does), then a cosine decay to ``min_lr_ratio`` at progress 1."""
    if cfg.warmup is not None:
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
    elif progress < WARMUP_FRACTION:  # this step counted done: with 2000 steps the same ramp as 200 warm-up steps
        return cfg.lr * min(1.0, max(progress, (step + 1) / cfg.steps) / WARMUP_FRACTION)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def sample_batch(stream: torch.Tensor, seq_len: int, batch_size: int, seed: int,
                 step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed windows; the generator is keyed on (seed, step) so a resumed run draws
    exactly the batches the uninterrupted run would have."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, stream.numel() - seq_len, (batch_size,), generator=gen)
    idx = starts.to(stream.device)[:, None] + torch.arange(seq_len + 1, device=stream.device)
    window = stream[idx].long()
    return window[:, :-1], window[:, 1:]


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


@torch.no_grad()
def evaluate(model: Llama, stream: torch.Tensor, seq_len: int, batch_size: int,
             device: torch.device, max_windows: int | None = None) -> tuple[float, int]:
    """Summed next-token loss (nats) and the number of predicted tokens.

    Windows tile the stream with a one-token overlap, so every token but the first is
    predicted exactly once, each with the context of its own window only (a slightly
    pessimistic but reproducible perplexity). ``max_windows`` keeps evenly spread windows.
    """
    was_training = model.training
    model.eval()
    starts = list(range(0, max(stream.numel() - 1, 0), seq_len))
    if max_windows is not None and len(starts) > max_windows:
        pick = torch.linspace(0, len(starts) - 1, max_windows).round().long().tolist()
        starts = [starts[i] for i in pick]
    total, count = torch.zeros((), device=device), 0  # one device->host read at the end
    for i in range(0, len(starts), batch_size):
        chunk = starts[i:i + batch_size]
        inputs = torch.full((len(chunk), seq_len), PAD_ID, dtype=torch.long)
        targets = torch.full((len(chunk), seq_len), -100, dtype=torch.long)
        for row, s in enumerate(chunk):
            w = stream[s:s + seq_len + 1].long()  # ``stream`` lives on the host
            inputs[row, :w.numel() - 1] = w[:-1]
            targets[row, :w.numel() - 1] = w[1:]
            count += w.numel() - 1
        inputs, targets = inputs.to(device), targets.to(device)
        with autocast(device):
            logits = model(inputs)
        total += F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1),
                                 ignore_index=-100, reduction="sum")
    model.train(was_training)
    return float(total), count


def _optimizer(model: Llama, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norm gains
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                             fused=device.type == "cuda")


def _tokenizer_for(cfg: TrainConfig, train_texts: list[str]):
    if cfg.tokenizer is not None:
        return load_tokenizer(cfg.tokenizer)
    if cfg.resume and (cfg.out / "tokenizer.json").is_file():
        return load_tokenizer(cfg.out)
    return train_tokenizer(train_texts, cfg.vocab_size)


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) one training; export the best weights as an HF folder in ``cfg.out``.

    Returns the final metrics (also written to ``out/train/metrics.json``).
    """
    check_vocab_size(cfg.vocab_size)
    cfg.model_config(cfg.vocab_size)  # fail on a bad shape before any expensive work
    wall0 = time.perf_counter()
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    log = (lambda *a: None) if cfg.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))

    corpus = load_corpus(cfg.paths or None, heldout=cfg.heldout)
    log(f"corpus: {corpus.describe()}")
    if cfg.warmup is not None and cfg.warmup >= cfg.steps:
        log(f"warning: --warmup {cfg.warmup} is not shorter than --steps {cfg.steps}: the learning rate "
            f"{'never reaches' if cfg.warmup > cfg.steps else 'reaches only at the last step'} its peak {cfg.lr} "
            "and never decays (leave --warmup out for 10% of the run)")
    tok = _tokenizer_for(cfg, texts(corpus.train))
    save_tokenizer(tok, cfg.out, model_max_length=cfg.seq_len)
    train_stream = encode_documents(tok, texts(corpus.train))
    val_stream = encode_documents(tok, texts(corpus.val))
    if train_stream.numel() <= cfg.seq_len + 1:
        raise ValueError(f"the training corpus has {train_stream.numel()} tokens, fewer than "
                         f"one window of seq_len + 1 = {cfg.seq_len + 1}; add text or lower "
                         "--seq-len")
    log(f"tokens: {train_stream.numel():,} train, {val_stream.numel():,} held-out "
        f"(vocab {tok.get_vocab_size()})")
    train_stream = train_stream.to(device)  # the held-out stream stays on the host (see evaluate)

    mcfg = cfg.model_config(tok.get_vocab_size())
    model = Llama(mcfg).to(device)
    optim = _optimizer(model, cfg, device)
    state_dir = cfg.out / "train"
    state_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path, best_path = state_dir / "checkpoint.pt", state_dir / "best.pt"
    if not cfg.resume:
        for stale in (ckpt_path, best_path, state_dir / "log.jsonl"):
            stale.unlink(missing_ok=True)
    step, elapsed, tokens_seen, best_val = 0, 0.0, 0, math.inf
    lr, lr_max = 0.0, 0.0  # the latest and the highest learning rate since this run (re)started: log, metrics
    if cfg.resume and ckpt_path.is_file():
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)
        if ckpt["model_config"] != mcfg.to_dict():
            raise ValueError(f"cannot resume {ckpt_path}: it was trained with model config "
                             f"{ckpt['model_config']}, not {mcfg.to_dict()}")
        model.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        step, elapsed = ckpt["step"], ckpt["elapsed"]
        tokens_seen, best_val = ckpt["tokens_seen"], ckpt["best_val"]
        _set_rng_state(ckpt["rng"], device)  # dropout masks continue as if never stopped
        log(f"resumed from {ckpt_path} at step {step}")
    log(f"model: {model.num_parameters():,} parameters, {mcfg}")

    forward = model
    if cfg.compile:
        forward = torch.compile(model)

    def save(best: bool) -> None:
        torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": step,
                    "elapsed": elapsed, "tokens_seen": tokens_seen, "best_val": best_val,
                    "model_config": mcfg.to_dict(), "train_config": _jsonable(cfg),
                    "rng": _rng_state(device)}, ckpt_path)
        if best:
            torch.save({"model": model.state_dict(), "step": step, "val_loss": best_val,
                        "model_config": mcfg.to_dict()}, best_path)

    def periodic_eval() -> None:
        nonlocal best_val
        nats, count = evaluate(model, val_stream, cfg.seq_len, cfg.batch_size, device,
                               cfg.eval_windows)
        val = nats / max(count, 1)
        improved = val < best_val
        best_val = min(best_val, val)
        save(improved)
        record = {"step": step, "tokens_seen": tokens_seen, "elapsed": round(elapsed, 1),
                  "train_loss": round(last_loss, 4) if last_loss is not None else None,
                  "val_loss": round(val, 4), "lr": float(f"{lr:.4g}")}
        with open(state_dir / "log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if not cfg.quiet:
            bar.write(f"step {step}: val loss {val:.4f} (best {best_val:.4f})", file=sys.stderr)

    model.train()
    ema: float | None = None  # smoothed, for the progress bar
    last_loss: float | None = None  # the latest sampled batch loss, for the log
    train_time, train_tokens = 0.0, 0
    bar = tqdm(total=cfg.steps, initial=step, disable=cfg.quiet, dynamic_ncols=True,
               mininterval=1.0 if sys.stderr.isatty() else 30.0, desc="train")
    start = time.perf_counter() - elapsed
    session_start, session_step = time.perf_counter(), step  # a resumed run measures its own steps
    while step < cfg.steps:
        elapsed = time.perf_counter() - start
        progress = step / cfg.steps
        if cfg.max_time is not None:
            if elapsed >= cfg.max_time:
                break
            progress = max(progress, elapsed / cfg.max_time)
        lr = lr_at(cfg, step, progress)
        lr_max = max(lr_max, lr)
        for group in optim.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        inputs, targets = sample_batch(train_stream, cfg.seq_len, cfg.batch_size, cfg.seed, step)
        with autocast(device):
            try:
                logits = forward(inputs)
            except Exception as exc:  # a failed compile must not lose the run
                if forward is model:
                    raise
                log(f"torch.compile failed ({type(exc).__name__}: {exc}); running eagerly")
                forward = model
                logits = model(inputs)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optim.step()
        step += 1
        tokens_seen += inputs.numel()
        train_tokens += inputs.numel()
        if step % 10 == 0 or step == cfg.steps or step < 10:
            last_loss = loss.item()  # the one host sync, every few steps
            ema = last_loss if ema is None else 0.7 * ema + 0.3 * last_loss
            train_time += time.perf_counter() - t0
            bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.2e}",
                            tok_s=f"{train_tokens / max(train_time, 1e-9):,.0f}", refresh=False)
        else:
            train_time += time.perf_counter() - t0
        bar.update(1)
        if step == session_step + 3 and cfg.max_time is not None:
            per_step = (time.perf_counter() - session_start) / 3
            fit = step + int(max(cfg.max_time - (time.perf_counter() - start), 0) / per_step)
            if fit < cfg.steps:
                log(f"--max-time {cfg.max_time:g} s fits about {fit} of {cfg.steps} steps ({per_step:.2f} s a step): "
                    "the learning-rate schedule follows the clock")
            if cfg.warmup is not None and cfg.warmup > fit:
                log(f"warning: --warmup {cfg.warmup} is longer than the ~{fit} steps that fit in --max-time: the "
                    f"learning rate will not reach its peak {cfg.lr} (leave --warmup out to scale it to the budget)")
        if step == 3 and device.type == "cpu" and cfg.max_time is None:
            per_step = (time.perf_counter() - start) / 3
            if per_step * (cfg.steps - step) > 3600:
                log(f"warning: {per_step:.1f} s a step on the CPU: {cfg.steps} steps take about "
                    f"{per_step * cfg.steps / 3600:.1f} h. Pass --max-time SECONDS to fit a budget, or a smaller "
                    f"shape (--hidden-size 128 --layers 4 --seq-len 256 --batch-size 8)")
        if step % cfg.eval_every == 0:
            elapsed = time.perf_counter() - start
            periodic_eval()
        if cfg.stop_after is not None and step >= cfg.stop_after:
            elapsed = time.perf_counter() - start
            save(False)
            bar.close()
            log(f"paused at step {step}; continue with --resume")
            return {"steps": step, "paused": True}
    bar.close()
    elapsed = time.perf_counter() - start
    if step % cfg.eval_every != 0 or not best_path.is_file():
        periodic_eval()

    best = torch.load(best_path, map_location=device, weights_only=False)
    model.load_state_dict(best["model"])
    nats, count = evaluate(model, val_stream, cfg.seq_len, cfg.batch_size, device)
    val_loss = nats / max(count, 1)
    export_hf(model, cfg.out, dtype=torch_dtype(cfg.dtype))
    metrics = {
        "params": model.num_parameters(),
        "checkpoint_mib": round(hf_checkpoint_bytes(cfg.out) / 2**20, 3),
        "vocab_size": mcfg.vocab_size, "hidden_size": mcfg.hidden_size,
        "layers": mcfg.num_hidden_layers, "heads": mcfg.num_attention_heads,
        "kv_heads": mcfg.num_key_value_heads, "intermediate_size": mcfg.intermediate_size,
        "seq_len": cfg.seq_len, "batch_size": cfg.batch_size, "lr": cfg.lr,
        "dropout": cfg.dropout, "steps": step, "best_step": best["step"],
        "lr_max": float(f"{lr_max:.4g}"), "lr_last": float(f"{lr:.4g}"),
        "tokens_seen": tokens_seen, "train_tokens": int(train_stream.numel()),
        "epochs": round(tokens_seen / train_stream.numel(), 2),
        "tokens_per_s": round(train_tokens / max(train_time, 1e-9)),
        "val_tokens": count, "val_bytes": corpus.val_bytes, "split": corpus.split,
        "val_loss": round(val_loss, 4), "val_ppl": round(math.exp(val_loss), 3),
        "val_bits_per_byte": round(nats / math.log(2) / max(corpus.val_bytes, 1), 4),
        "train_seconds": round(elapsed, 1),
        "wall_seconds": round(time.perf_counter() - wall0, 1),
    }
    (state_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log(f"done: {json.dumps(metrics)}")
    return metrics


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def _jsonable(cfg: TrainConfig) -> dict:
    d = asdict(cfg)
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()}
