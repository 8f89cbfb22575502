"""A Hugging Face model directory with random weights (a pagedlab preset) and a word-level tokenizer
that covers the whole vocabulary (word w<i> is token i; bench serve's prompt words are tokens too), so
pagedlab and `transformers serve` serve the very same checkpoint and every prompt word is one token.

    python scripts/make_random_hf_checkpoint.py llama-3.2-1b /tmp/ckpt bfloat16
"""
import json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from pagedlab.weights import random_checkpoint, RANDOM_PRESETS

preset, out, dtype = sys.argv[1], Path(sys.argv[2]), getattr(torch, sys.argv[3] if len(sys.argv) > 3 else "bfloat16")
cfg = RANDOM_PRESETS[preset]()
ck = random_checkpoint(cfg, 0)
out.mkdir(parents=True, exist_ok=True)
tensors = {k: v.to(dtype).contiguous() for k, v in ck.tensors.items()}
if cfg.tie_word_embeddings:
    tensors.pop("lm_head.weight", None)
save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
hf = dict(cfg.to_hf_dict(), architectures=["LlamaForCausalLM"], model_type="llama",
          torch_dtype=str(dtype).replace("torch.", ""))
(out / "config.json").write_text(json.dumps(hf, indent=1))
eos = cfg.eos_token_ids[0]
vocab = {f"w{i}": i for i in range(cfg.vocab_size)}
vocab.pop(f"w{cfg.bos_token_id}"); vocab["<s>"] = cfg.bos_token_id
vocab.pop(f"w{eos}"); vocab["</s>"] = eos
from pagedlab.bench.serve import WORDS      # bench serve's prompt words: one token each
for j, w in enumerate(dict.fromkeys(WORDS.split() if isinstance(WORDS, str) else WORDS)):
    if w not in vocab:
        vocab.pop(f"w{100 + j}"); vocab[w] = 100 + j
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w5"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="w5")
fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
fast.save_pretrained(str(out))
(out / "generation_config.json").write_text(json.dumps({"bos_token_id": cfg.bos_token_id, "eos_token_id": eos}))
print("wrote", out, sorted(p.name for p in out.iterdir()))
