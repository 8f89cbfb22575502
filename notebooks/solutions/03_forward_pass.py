# Solutions to notebook 03. Run from the notebook (uses LLAMA_3_2_1B, cfg, inv_freq, forward, ours, rel_err).
import dataclasses

# 1. Matmul FLOPs 2*N*T vs attention 4*T^2*layers*heads*head_dim (QK^T and PV, causal halves it;
#    ignored here). Equal when T = 2*N / (4*layers*heads*head_dim) = N / (2*layers*heads*head_dim).
L = LLAMA_3_2_1B
n = L.num_parameters()        # the tied embedding is used once, as the output head's matmul
t_eq = n / (2 * L.num_layers * L.num_heads * L.head_dim)
print(f"attention FLOPs equal the matmuls' at about T = {t_eq:,.0f} tokens")

# 2. Without llama3 scaling.
scaled = freqs
freqs = inv_freq(dataclasses.replace(cfg, rope_scaling=None)).to(DEVICE)
with torch.no_grad():
    unscaled_logits = forward(ids)
freqs = scaled
print(f"logits change by {rel_err(unscaled_logits, ours):.2e} (relative)")
# The scaling only changes wavelengths longer than original_max_position_embeddings / low_freq_factor
# tokens (8192 for Llama-3.2-1B): over a short prompt those rotations are tiny either way, so the
# change is small. The tiny random model's original length is only 64, so there it is large.
