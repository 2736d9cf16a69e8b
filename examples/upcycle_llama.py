"""Upcycle a Llama to mHC: convert it (same logits), fine-tune it, compare with the plain model.

    python examples/upcycle_llama.py                      # tiny Llama built from a config
    python examples/upcycle_llama.py --steps 100          # shorter
    python examples/upcycle_llama.py --checkpoint path/   # a local transformers causal LM

Without --checkpoint, a tiny byte-level Llama (vocabulary 256) is built from a config and
first trained for --pretrain-steps on the built-in corpus (the Python standard library's
source, torch_mhc.lm.data), standing in for a pretrained checkpoint. Then two copies are
fine-tuned for --steps on the same batches: the plain model and the model converted to
--kind with --streams streams. The script prints the logit difference at conversion, the
validation loss of both, and the Amax gains of the converted model's residual maps.
With --checkpoint, the checkpoint's own tokenizer encodes the corpus.
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import numpy as np
import torch
import transformers
from tqdm import tqdm

import torch_mhc
import torch_mhc.hf
from torch_mhc.lm.data import BatchSampler, load_corpus, val_batches


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", help="a local transformers causal LM folder (default: tiny "
                   "Llama from a config)")
    p.add_argument("--steps", type=int, default=300, help="fine-tuning steps per model")
    p.add_argument("--pretrain-steps", type=int, default=200,
                   help="steps that train the tiny Llama before conversion (no --checkpoint)")
    p.add_argument("--kind", default="mhc", choices=torch_mhc.CONNECTION_KINDS,
                   help="connection kind")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--max-bytes", type=int, default=4_000_000, help="corpus bytes to use")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", help="save the converted, fine-tuned model to this folder")
    return p.parse_args()


def tiny_llama(seed: int) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def corpus_tokens(args, tokenizer=None) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) token arrays: bytes, or the checkpoint tokenizer's ids."""
    corpus = load_corpus(None, max_bytes=args.max_bytes)
    if tokenizer is None:
        return np.asarray(corpus.train), np.asarray(corpus.val)
    encode = lambda a: np.asarray(tokenizer(bytes(a).decode("utf-8", "replace"))["input_ids"])  # noqa: E731
    return encode(corpus.train), encode(corpus.val)


def train(model, tokens, args, steps: int, desc: str) -> list[float]:
    """AdamW with torch_mhc.param_groups (no decay on the connections' static maps and gates),
    cosine learning rate; the batches depend only on the seed, so every model sees the same."""
    model.train()
    opt = torch.optim.AdamW(torch_mhc.param_groups(model, weight_decay=0.1), lr=args.lr,
                            betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    sampler = BatchSampler(tokens, args.batch_size, args.seq_len, seed=args.seed + 1)
    losses = []
    for _ in (bar := tqdm(range(steps), desc=desc, leave=False)):
        x, y = sampler.next()  # [B, T] each
        logits = model(x).logits  # [B, T, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    return losses


@torch.no_grad()
def val_loss(model, tokens, args) -> float:
    model.eval()
    total, count = 0.0, 0
    for x, y in val_batches(tokens, args.batch_size, args.seq_len, max_batches=8):
        logits = model(x).logits
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(),
                                                   reduction="sum").item()
        count += y.numel()
    return total / count


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    if args.checkpoint:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.checkpoint)
        base = transformers.AutoModelForCausalLM.from_pretrained(args.checkpoint,
                                                                 dtype=torch.float32)
        train_tokens, val_tokens = corpus_tokens(args, tokenizer)
    else:
        base = tiny_llama(args.seed)
        train_tokens, val_tokens = corpus_tokens(args)
        if args.pretrain_steps:
            losses = train(base, train_tokens, args, args.pretrain_steps, "pretrain (plain)")
            tail = losses[-20:]
            print(f"pretrained {args.pretrain_steps} steps: train loss (last {len(tail)}) "
                  f"{sum(tail) / len(tail):.3f}")
    n_params = sum(p.numel() for p in base.parameters())
    print(f"model: {type(base).__name__}, {n_params / 1e6:.2f} M parameters; corpus "
          f"{len(train_tokens):,} train / {len(val_tokens):,} val tokens")

    plain, converted = copy.deepcopy(base), copy.deepcopy(base)
    torch_mhc.hf.convert(converted, kind=args.kind, streams=args.streams)
    x, _ = next(val_batches(val_tokens, 4, args.seq_len, max_batches=1))
    with torch.no_grad():
        ref, out = plain.eval()(x).logits, converted.eval()(x).logits
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    added = sum(p.numel() for _, p in torch_mhc.hf.connection_parameters(converted))
    print(f"converted to {args.kind} x{args.streams}: +{added:,} parameters; max |logit diff|"
          f" / max |logit| = {rel:.2e}")

    results = {}
    for name, model in (("plain", plain), (f"{args.kind} x{args.streams}", converted)):
        before = val_loss(model, val_tokens, args)
        start = time.perf_counter()
        losses = train(model, train_tokens, args, args.steps, f"fine-tune {name}")
        results[name] = (before, val_loss(model, val_tokens, args),
                         sum(losses[-20:]) / len(losses[-20:]), time.perf_counter() - start)

    print(f"\nfine-tuning, {args.steps} steps, batch {args.batch_size} x {args.seq_len}:")
    print(f"| model | val loss before | val loss after | train loss (last {min(20, args.steps)})"
          " | time (s) |")
    print("|---|---|---|---|---|")
    for name, (before, after, last, secs) in results.items():
        print(f"| {name} | {before:.4f} | {after:.4f} | {last:.4f} | {secs:.1f} |")

    if args.kind != "residual":  # the plain residual has no maps to report
        print_gains(converted, x)
    if args.save:
        print(f"saved to {torch_mhc.hf.save_pretrained(converted, args.save)}")
    print(f"total {time.perf_counter() - t0:.0f} s")


def print_gains(converted, x) -> None:
    """Amax gains (mHC paper section 3.1) of every connection's H_res and of their product."""
    with torch_mhc.collect_gains() as gains, torch.no_grad():
        converted.eval()(x)
    report = gains.report()
    print(f"\nAmax gain of the residual maps ({len(report.layers)} connections, one val batch):")
    print(f"  per layer, worst token: forward {max(c['max'] for c in report.layer_fwd):.4f}, "
          f"backward {max(c['max'] for c in report.layer_bwd):.4f}")
    print(f"  composite (all layers), worst token: forward {report.max_composite_fwd:.4f}, "
          f"backward {report.max_composite_bwd:.4f}")


if __name__ == "__main__":
    main()
