"""`python -m pagedlab bench fp8`: FP8 weights (quantization="fp8") against the unquantized model.

  quality (--quality; any device, CPU is fine): SmolLM2-135M, teacher forcing over TEXT (below, or
          --text FILE): the same token sequence through the fp32 model, the bf16 model, and the
          FP8-weight model with fp32 and with bf16 activations. Reported against fp32 and against
          bf16: next-token (argmax) agreement, mean KL(reference || other) of the next-token
          distributions, and each one's perplexity on the text; plus the FP8 round-trip error of
          every linear weight (relative Frobenius error, per layer).
  speed (the default; CUDA): random Llama-3.2-1B, bf16 against FP8 weights in one process: one
          stream (bench engine's: 128-token prompt, 256 new tokens, median of 5) tokens/s, its
          share of the weight-bandwidth floor, and (unless --no-offline) bench engine's offline
          workload (256 requests, lengths U[100, 1024]; the second of two passes).

JSON (and a markdown summary) go to --out (default docs/: fp8_quality.json, fp8_speed.json).
"""
from __future__ import annotations

import argparse
import gc
import math
import sys
import time

import torch

from pagedlab.bench.common import metadata, out_dir, write_json

# The text perplexity is measured on: the opening of Dickens' "A Tale of Two Cities" (public
# domain, and likely seen in pretraining) and two paragraphs written for this benchmark (not).
TEXT = """It was the best of times, it was the worst of times, it was the age of wisdom, it was the age \
of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of \
Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had \
everything before us, we had nothing before us, we were all going direct to Heaven, we were all going \
direct the other way -- in short, the period was so far like the present period, that some of its \
noisiest authorities insisted on its being received, for good or for evil, in the superlative degree \
of comparison only.

There were a king with a large jaw and a queen with a plain face, on the throne of England; there \
were a king with a large jaw and a queen with a fair face, on the throne of France. In both countries \
it was clearer than crystal to the lords of the State preserves of loaves and fishes, that things in \
general were settled for ever.

When a language model writes one word at a time, most of the work is not arithmetic at all: it is \
moving numbers. Every weight of the network has to travel from memory to the processor once for each \
new word, and the processor finishes its few multiplications long before the next weights arrive. \
A model of one billion parameters stored in sixteen bits reads two gigabytes per word; a memory that \
delivers five terabytes a second can therefore produce at most two thousand five hundred words a \
second, however fast the arithmetic units are.

Storing each weight in eight bits instead of sixteen halves the bytes and so, nearly, the time. The \
price is precision: an eight-bit floating-point number keeps three bits of mantissa, so each weight \
is rounded to within about six percent of its value. Because every row of a weight matrix gets its \
own scale, one unusually large weight only coarsens its own row, and the errors of many small \
roundings mostly cancel in the long sums of a matrix product. Whether that is good enough is a \
question for measurement, not for argument: compare the predictions, word by word, with and without.
"""

# name: (weights' quantization, activation dtype, FP8 matmuls' activations (quantization.fp8_linear),
#        LM head kept unquantized)
QUALITY_VARIANTS = {
    "fp32": (None, torch.float32, "keep", False),
    "bf16": (None, torch.bfloat16, "keep", False),
    "fp8 weights, fp32 activations": ("fp8", torch.float32, "keep", False),
    # what the batch-1 decode kernels compute on a GPU
    "fp8 weights, bf16 activations": ("fp8", torch.bfloat16, "keep", False),
    # what torch._scaled_mm computes on a GPU (sm89+) for prefill and decode batches
    "fp8 weights and activations (per token), bf16": ("fp8", torch.bfloat16, "fp8-reference", False),
    # what quantizing the LM head costs (the engine quantizes it: it is a fifth of Llama-3.2-1B's bytes)
    "fp8 weights but the LM head, bf16 activations": ("fp8", torch.bfloat16, "keep", True),
}


def teacher_forced_logits(model, ids: list[int]) -> torch.Tensor:
    """fp32 logits [T, vocab] of every position of `ids` (one sequence, one prefill through the
    model's own kernels and a fresh paged cache): row t predicts token t + 1."""
    from pagedlab.attention import AttentionMetadata
    from pagedlab.kv_cache import KVCache

    c, dev, t = model.config, model.device, len(ids)
    bs = 16
    nb = (t + bs - 1) // bs
    kv = KVCache(c.num_layers, nb, bs, model.num_kv_heads, c.head_dim, model.dtype, dev)
    table = torch.arange(nb, dtype=torch.int32, device=dev)[None]
    i32 = dict(dtype=torch.int32, device=dev)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(t, device=dev), num_prefill_tokens=t, prefill_block_table=table,
        cu_seqlens_q=torch.tensor([0, t], **i32), prefill_seq_lens=torch.tensor([t], **i32),
        max_q_len=t, decode_block_table=table[:0], decode_seq_lens=torch.zeros(0, **i32), max_seq_len=0)
    ids_t = torch.tensor(ids, device=dev)
    return model.forward(ids_t, torch.arange(t, device=dev), kv, meta).float()


def compare(ref: torch.Tensor, other: torch.Tensor) -> dict:
    """Next-token agreement (argmax equal) and mean KL(ref || other) over the positions."""
    lp_r, lp_o = ref.double().log_softmax(-1), other.double().log_softmax(-1)
    kl = (lp_r.exp() * (lp_r - lp_o)).sum(-1)
    return {"agreement": (ref.argmax(-1) == other.argmax(-1)).double().mean().item(),
            "kl_mean": kl.mean().item(), "kl_max": kl.max().item()}


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:], device=logits.device))
    return math.exp(nll.item())


def weight_errors(ckpt) -> list[dict]:
    """The FP8 round-trip error of every linear weight of the checkpoint, layer by layer."""
    from pagedlab.quantization import quantization_error
    c = ckpt.config
    rows = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        for short, name in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
                            ("o", "self_attn.o_proj"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"),
                            ("down", "mlp.down_proj")):
            rows.append(dict(layer=i, weight=short, **quantization_error(ckpt.tensors[p + name + ".weight"])))
    head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
    rows.append(dict(layer=c.num_layers, weight="lm_head", **quantization_error(ckpt.tensors[head])))
    return rows


def quality(model: str = "smollm2", text: str = TEXT, device: str = "cpu", max_tokens: int = 1024,
            backend: str = "torch", argv=()) -> dict:
    """The quality numbers (see the module docstring) as a dict."""
    from pagedlab.kernels import select_kernels
    from pagedlab.llm import make_tokenizer
    from pagedlab.model import LlamaModel
    from pagedlab.quantization import activations_mode
    from pagedlab.weights import load_checkpoint

    ckpt = load_checkpoint(model, show_progress=False)
    ids = make_tokenizer(ckpt).encode(text)[:max_tokens]
    if ckpt.config.bos_token_id is not None and ids[:1] != [ckpt.config.bos_token_id]:
        ids = [ckpt.config.bos_token_id] + ids[:max_tokens - 1]
    logits, times = {}, {}
    for name, (quant, dtype, acts, keep_head) in QUALITY_VARIANTS.items():
        t0 = time.perf_counter()
        m = LlamaModel(ckpt.config, ckpt.tensors, device, dtype, select_kernels(backend),
                       max_positions=len(ids), quantization=quant)
        if keep_head:
            m.lm_head = m.embed if ckpt.config.tie_word_embeddings else \
                ckpt.tensors["lm_head.weight"].to(device=device, dtype=dtype)
        with activations_mode(acts):
            logits[name] = teacher_forced_logits(m, ids)[:-1]
        times[name] = time.perf_counter() - t0
        del m
    res = dict(metadata("python -m pagedlab bench fp8", list(argv)), model=ckpt.source, device=device,
               backend=backend, tokens=len(ids), predictions=len(ids) - 1, seconds=times,
               perplexity={n: perplexity(torch.cat([lg, lg[-1:]]), ids) for n, lg in logits.items()},
               vs_fp32={n: compare(logits["fp32"], lg) for n, lg in logits.items() if n != "fp32"},
               vs_bf16={n: compare(logits["bf16"], lg) for n, lg in logits.items() if n.startswith("fp8")})
    errs = weight_errors(ckpt)
    res["weight_error"] = errs
    res["weight_error_summary"] = {
        w: {"rel_err_mean": sum(e["rel_err"] for e in errs if e["weight"] == w) / max(1, sum(e["weight"] == w for e in errs)),
            "rel_err_max": max(e["rel_err"] for e in errs if e["weight"] == w)}
        for w in dict.fromkeys(e["weight"] for e in errs)}
    return res


def quality_table(res: dict) -> str:
    lines = [f"{res['model']}, {res['predictions']} next-token predictions under teacher forcing "
             f"({res['device']}, torch {res['torch']}, {res['date']})", "",
             "| model | perplexity | agreement vs fp32 | KL vs fp32 (mean / max) | agreement vs bf16 | KL vs bf16 (mean / max) |",
             "|---|---|---|---|---|---|"]
    for n, ppl in res["perplexity"].items():
        a, b = res["vs_fp32"].get(n), res["vs_bf16"].get(n)
        fa = f"{a['agreement']:.2%} | {a['kl_mean']:.2e} / {a['kl_max']:.2e}" if a else "-- | --"
        fb = f"{b['agreement']:.2%} | {b['kl_mean']:.2e} / {b['kl_max']:.2e}" if b else "-- | --"
        lines.append(f"| {n} | {ppl:.3f} | {fa} | {fb} |")
    lines += ["", "| weight | FP8 relative error, mean over layers | max |", "|---|---|---|"]
    for w, s in res["weight_error_summary"].items():
        lines.append(f"| {w} | {s['rel_err_mean']:.4f} | {s['rel_err_max']:.4f} |")
    return "\n".join(lines)


def speed(model: str = "random:llama-3.2-1b", offline: bool = True, requests: int = 256,
          weights=("bf16", "fp8"), argv=()) -> dict:
    """One stream (and the offline workload) in bf16 and with FP8 weights, on CUDA."""
    from pagedlab.bench.common import copy_bandwidth_tbs, device_line, random_prompt, require_cuda
    from pagedlab.bench.engine import offline_workload, one_stream, run_pagedlab
    from pagedlab.llm import LLM
    from pagedlab.weights import load_checkpoint

    require_cuda("bench fp8")
    ckpt = load_checkpoint(model, show_progress=False)
    bw = copy_bandwidth_tbs(torch.device("cuda")) * 1e12
    prompts, out_lens = offline_workload(requests)
    need = max(len(a) + b for a, b in zip(prompts, out_lens))
    res = dict(metadata("python -m pagedlab bench fp8", list(argv)), model=ckpt.source,
               copy_bandwidth_TBps=bw / 1e12, runs={})
    res["device_line"] = device_line(res)
    for name in weights:
        quant = None if name == "bf16" else name
        t0 = time.perf_counter()
        llm = LLM(checkpoint=ckpt, device="cuda", dtype="bfloat16", max_num_seqs=requests,
                  max_model_len=max(need + 16, 2048), show_progress=False, quantization=quant)
        m = llm.model
        # bytes one decode step reads: all weights but the embedding table (one row of it), unless
        # it is also the LM head
        read = m.num_bytes() - (0 if m.lm_head is m.embed else m.embed.numel() * m.embed.element_size())
        r = dict(setup_s=time.perf_counter() - t0, weight_GB=m.num_bytes() / 1e9, read_GB=read / 1e9)
        r["floor_tokens_per_s"] = bw / read
        r["one_stream"] = one_stream(llm, random_prompt())
        r["one_stream"]["of_floor"] = r["one_stream"]["tokens_per_s"] / r["floor_tokens_per_s"]
        print(name, "one stream", round(r["one_stream"]["tokens_per_s"], 1), "tokens/s", flush=True)
        if offline:
            r["offline_warmup"] = run_pagedlab(llm, prompts, out_lens)
            r["offline"] = run_pagedlab(llm, prompts, out_lens)
            print(name, "offline", round(r["offline"]["tokens_per_s"], 1), "tokens/s", flush=True)
        res["runs"][name] = r
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return res


def speed_table(res: dict) -> str:
    lines = [res["device_line"], "",
             "| weights | GB read per token | floor tokens/s | one stream tokens/s | of floor | offline tokens/s |",
             "|---|---|---|---|---|---|"]
    for n, r in res["runs"].items():
        off = f"{r['offline']['tokens_per_s']:,.0f}" if "offline" in r else "not run"
        lines.append(f"| {n} | {r['read_GB']:.3f} | {r['floor_tokens_per_s']:,.0f} | "
                     f"{r['one_stream']['tokens_per_s']:,.0f} | {r['one_stream']['of_floor']:.2f} | {off} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m pagedlab bench fp8", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quality", action="store_true",
                   help="agreement, KL and perplexity against fp32/bf16 (any device) instead of speed")
    p.add_argument("--model", default=None, help="quality: smollm2; speed: random:llama-3.2-1b")
    p.add_argument("--device", default="cpu", help="quality: where the models run (cpu or cuda)")
    p.add_argument("--backend", default="torch", choices=["torch", "triton"], help="quality: kernels")
    p.add_argument("--text", default=None, help="quality: a UTF-8 text file instead of the built-in TEXT")
    p.add_argument("--no-offline", action="store_true", help="speed: one stream only")
    p.add_argument("--weights", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"],
                   help="speed: which weights to run")
    p.add_argument("--out", default="docs", help="where fp8_quality.json / fp8_speed.json go")
    args = p.parse_args(argv)
    out = out_dir(args.out)
    if not args.quality:
        res = speed(args.model or "random:llama-3.2-1b", offline=not args.no_offline, weights=args.weights,
                    argv=sys.argv[1:] if argv is None else argv)
        write_json(out / "fp8_speed.json", res)
        print(speed_table(res))
        return
    text = open(args.text, encoding="utf-8").read() if args.text else TEXT
    res = quality(args.model or "smollm2", text, args.device, backend=args.backend,
                  argv=sys.argv[1:] if argv is None else argv)
    write_json(out / "fp8_quality.json", res)
    print(quality_table(res))


if __name__ == "__main__":
    main()
