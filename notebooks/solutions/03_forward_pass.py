# Solutions to notebook 03. Run from the notebook (uses LLAMA_3_2_1B, cfg, inv_freq, forward, ids, ours, rel_err).
import dataclasses
import math

# 1. Matmul FLOPs 2*N*T vs attention 4*T^2*layers*heads*head_dim (QK^T and PV, causal halves it;
#    ignored here). Equal when T = 2*N / (4*layers*heads*head_dim) = N / (2*layers*heads*head_dim).
for c in (cfg, LLAMA_3_2_1B):
    n = c.num_parameters()        # a tied embedding is used once, as the output head's matmul
    t_eq = n / (2 * c.num_layers * c.num_heads * c.head_dim)
    print(f"{c.name}: attention FLOPs equal the matmuls' at about T = {t_eq:,.0f} tokens")

# 2. Toggle the llama3 scaling of the loaded model.
other = None if cfg.rope_scaling else LLAMA_3_2_1B.rope_scaling
toggled = inv_freq(dataclasses.replace(cfg, rope_scaling=other))
touched = (toggled != inv_freq(cfg)).nonzero().flatten().tolist()
saved = freqs
freqs = toggled.to(DEVICE)
with torch.no_grad():
    toggled_logits = forward(ids)
freqs = saved
change = rel_err(toggled_logits, ours)
print(f"{'removing' if cfg.rope_scaling else 'adding'} llama3 scaling changes {len(touched)} of "
      f"{len(toggled)} frequencies and the logits by {change:.2e} (relative)")
assert change > 0 or not touched
# The scaling only changes frequencies whose wavelength is longer than
# original_max_position_embeddings / high_freq_factor tokens (2048 for Llama-3.2-1B's settings):
# over a prompt of len(ids) tokens those dimensions rotate by a small angle either way, so the
# change is small -- but not zero, and it grows with the distance between tokens.
longest = max(2 * math.pi / f for f in inv_freq(cfg).tolist())
print(f"{cfg.name}: longest wavelength {longest:,.0f} tokens, prompt {len(ids)} tokens")
