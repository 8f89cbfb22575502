"""Charts of numbers the notebooks measure or compute: bars, lines, bandwidth against a limit, KV
memory reserved vs used, a safetensors file's layout, RoPE's wavelengths, and the host and the
GPU taking turns or overlapping in the engine's step loop."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from .style import NUM_COLORS, PALETTE, ink, new_ax, request_color, tidy


def draw_bars(values: dict, ylabel: str, title: str = "", ax=None, fmt: str = "{:.2f}", colors=None):
    fig, ax = new_ax(ax, (max(4, 1.2 * len(values) + 1.5), 3))
    names = list(values)
    bars = ax.bar(names, [values[k] for k in names],
                  color=colors or ["#4c72b0", "#c44e52", "#55a868", "#8172b2", "#ccb974", "#64b5cd"][:len(names)])
    for b in bars:
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), fmt.format(b.get_height()),
                ha="center", va="bottom", fontsize=9)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_ylim(0, max([v for v in values.values()] + [1e-9]) * 1.2)
    return tidy(fig, ax)


def draw_fragmentation(used_tokens: dict, reserved_tokens: dict, title: str = "", ax=None):
    """Per scheme: tokens actually stored vs slots reserved but never used. Two panels (when no
    `ax` is given): the slots themselves, and the same bars as shares of what each scheme reserves
    -- so a scheme that reserves 30x less is still readable."""
    names = list(used_tokens)
    used = [used_tokens[k] for k in names]
    waste = [reserved_tokens[k] - used_tokens[k] for k in names]
    if ax is None:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9.5, 3.3), gridspec_kw={"width_ratios": [1.2, 1]})
    else:
        fig, ax2 = ax.figure, None
    ax.bar(names, used, color="#4c72b0", label="holds a token")
    ax.bar(names, waste, bottom=used, color="#dd8452", label="reserved, empty")
    for i, k in enumerate(names):
        ax.text(i, reserved_tokens[k], f"{reserved_tokens[k]:,} reserved\n{waste[i]:,} empty",
                ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("KV token slots")
    ax.set_ylim(0, max(reserved_tokens.values()) * 1.3)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(title, fontsize=10, loc="left")
    tidy(fig, ax, tight=False)
    if ax2 is not None:
        share = [w / max(1, reserved_tokens[k]) for w, k in zip(waste, names)]
        ax2.bar(names, [1 - x for x in share], color="#4c72b0")
        ax2.bar(names, share, bottom=[1 - x for x in share], color="#dd8452")
        for i, x in enumerate(share):
            ax2.text(i, 1 - x / 2 if x > 0.08 else 1.01, f"{x:.0%} wasted", ha="center",
                     va="center" if x > 0.08 else "bottom", fontsize=9,
                     color="white" if x > 0.08 else "black", fontweight="bold")
        ax2.set_ylim(0, 1.12)
        from matplotlib.ticker import PercentFormatter
        ax2.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax2.set_ylabel("share of the reserved slots")
        ax2.set_title("the same, as shares", fontsize=10, loc="left")
        tidy(fig, ax2, tight=False)
    fig.tight_layout()
    return fig


def draw_bandwidth(results: dict, limit_gbs: float | None, title: str = "", ax=None,
                   limit_label: str = "device copy bandwidth"):
    """results: {variant: {x_label: GB/s}} -> grouped bars, with the device's limit as a line."""
    import numpy as np
    fig, ax = new_ax(ax, (8, 3.4))
    variants = list(results)
    xs = list(next(iter(results.values())).keys()) if results else []
    w = 0.8 / max(1, len(variants))
    for j, v in enumerate(variants):
        ax.bar(np.arange(len(xs)) + j * w - 0.4 + w / 2, [results[v].get(x, 0) for x in xs], w, label=v)
    if limit_gbs:
        ax.axhline(limit_gbs, color="black", linestyle="--", linewidth=1,
                   label=f"{limit_label} {limit_gbs:.0f} GB/s")
    ax.set_xticks(range(len(xs)), [str(x) for x in xs], fontsize=8)
    ax.set_ylabel("K/V bytes read / time (GB/s)")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10, loc="left")
    return tidy(fig, ax)


def draw_lines(series: dict, xlabel: str, ylabel: str, title: str = "", ax=None, logx: bool = False,
               logy: bool = False):
    """series: {name: (xs, ys)} -> one line per name. logy: a log y axis, for series whose sizes
    differ by orders of magnitude (each line then keeps its shape instead of lying flat on zero)."""
    fig, ax = new_ax(ax, (5.5, 3.2))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o" if len(xs) <= 40 else None, label=name)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
        ax.grid(axis="y", which="major", alpha=0.3)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10, loc="left")
    return tidy(fig, ax)


def draw_safetensors_layout(header_len: int, entries: list, total: int, ax=None, max_labels: int = 12,
                            head: bytes | None = None):
    """The file as one bar: 8-byte length, JSON header, then each tensor's byte range.

    head: the file's first bytes (say 8 + 300). Given, the figure gets a top panel that shows them:
    the 8 length bytes in hex (little-endian, least significant first) and what they decode to,
    then the start of the JSON text -- the header that is a hair's width in the to-scale bar."""
    import struct
    import textwrap
    if head is not None and ax is None:
        fig, (top, ax) = plt.subplots(2, 1, figsize=(10, 3.9), gridspec_kw={"height_ratios": [1.7, 1]})
    else:
        fig, ax = new_ax(ax, (10, 1.8))
        top = None
    ax.add_patch(Rectangle((0, 0), 8, 1, facecolor="#c44e52"))
    ax.add_patch(Rectangle((8, 0), header_len, 1, facecolor="#ccb974"))
    base = 8 + header_len
    big = sorted(range(len(entries)), key=lambda j: entries[j][1] - entries[j][2])[:max_labels]
    for j, (name, start, end) in enumerate(entries):
        ax.add_patch(Rectangle((base + start, 0), end - start, 1, facecolor=PALETTE[j % NUM_COLORS],
                               edgecolor="white", linewidth=0.3))
        label = name.replace("model.", "")
        if j in big and len(label) * 0.0068 * total < (end - start):
            ax.text(base + (start + end) / 2, 0.5, label, ha="center", va="center",
                    fontsize=7, color=ink(PALETTE[j % NUM_COLORS]), clip_on=True)
    ax.set_xlim(0, total)
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_xlabel("byte offset in the file (to scale)")
    ax.set_title(f"the whole file, to scale: 8 + {header_len:,} header bytes ({base / total:.2%} of the "
                 f"file), then {len(entries)} tensors back to back, {total:,} bytes in all",
                 fontsize=9, loc="left")
    if top is not None:
        top.axis("off")
        top.set_xlim(0, 10)
        top.set_ylim(0, 4)
        n = struct.unpack("<Q", head[:8])[0]
        top.text(0, 3.75, "the first bytes of the file, not to scale", fontsize=10, va="center")
        for k in range(8):
            top.add_patch(Rectangle((0.42 * k, 2.5), 0.4, 0.75, facecolor="#c44e52", edgecolor="white"))
            top.text(0.42 * k + 0.2, 2.875, f"{head[k]:02x}", ha="center", va="center", color="white",
                     fontsize=9, family="monospace")
        top.text(3.5, 2.875, f"u64, little-endian: N = {n:,}  ->  the next N bytes are JSON",
                 va="center", fontsize=9)
        text = head[8:8 + min(n, 330)].decode("utf-8", errors="replace")
        shown = "\n".join(textwrap.wrap(text, 110)[:3]) + (" ..." if n > 330 else "")
        top.add_patch(Rectangle((0, 0.05), 10, 2.2, facecolor="#f4efd6", edgecolor="#ccb974"))
        top.text(0.1, 2.05, shown, va="top", fontsize=7.5, family="monospace")
        top.text(0.1, 0.25, "each tensor: dtype, shape, data_offsets = [start, end) counted from the end "
                 "of the header", fontsize=8, style="italic", color="#555555")
    fig.tight_layout()
    return fig


def draw_rope_wavelengths(plain_wl: list, used_wl: list, rope_scaling: dict | None = None, ax=None,
                          title: str = "RoPE: the wavelength of each rotation pair"):
    """One point per rotation pair i (x) and its wavelength 2*pi/inv_freq in tokens (y, log
    scale: the wavelengths span ~6 to ~10^6 tokens, so a linear axis shows only the last few).
    With llama3 scaling: the two thresholds as lines and the three regimes shaded."""
    fig, ax = new_ax(ax, (7.5, 3.6))
    i = list(range(len(plain_wl)))
    ax.plot(i, plain_wl, "o-", color="#4c72b0", markersize=3.5, label="no scaling")
    ax.plot(i, used_wl, "s-", color="#c44e52", markersize=3.5, label="llama3 scaling", alpha=0.85)
    ax.set_yscale("log")
    if rope_scaling:
        orig = rope_scaling["original_max_position_embeddings"]
        hi_wl = orig / rope_scaling["high_freq_factor"]
        lo_wl = orig / rope_scaling["low_freq_factor"]
        ax.axhspan(min(plain_wl) / 2, hi_wl, color="#55a868", alpha=0.10)
        ax.axhspan(hi_wl, lo_wl, color="#ccb974", alpha=0.18)
        ax.axhspan(lo_wl, max(used_wl) * 3, color="#c44e52", alpha=0.07)
        ax.axhline(orig, color="black", linestyle=":", linewidth=1)
        kw = dict(fontsize=8, transform=ax.get_yaxis_transform(), ha="left")
        ax.text(0.01, hi_wl * 0.7, f"< {hi_wl:.0f} tokens: unchanged", va="top", **kw)
        ax.text(0.01, (hi_wl * lo_wl) ** 0.5, "blended", va="center", **kw)
        ax.text(0.01, lo_wl * 1.4, f"> {lo_wl:.0f} tokens: divided by {rope_scaling['factor']:g} "
                f"(wavelength x{rope_scaling['factor']:g})", va="bottom", **kw)
        ax.text(0.99, orig * 1.15, f"original context {orig:,}", va="bottom", fontsize=8,
                transform=ax.get_yaxis_transform(), ha="right")
        ax.set_ylim(min(plain_wl) / 2, max(used_wl) * 3)
    ax.set_xlabel("rotation pair i (coordinates i and i + head_dim/2)")
    ax.set_ylabel("wavelength (tokens, log)")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title, fontsize=10, loc="left")
    return tidy(fig, ax)


def overlap_schedule(host_ms: float, gpu_ms: float, steps: int, overlap: bool) -> list[tuple]:
    """When each step's host work and GPU work run, as (lane, step, start_ms, end_ms).

    In turn (overlap=False): host work of step k (schedule, inputs, launch, then reading the
    token) and the GPU's step k alternate, so a step costs host + GPU. With overlap the host
    launches step k as soon as its own work for k is done, and its work for step k+1 waits only
    for the token of step k-1 (the one it reads): the GPU never waits while host < GPU."""
    spans, t, g_end = [], 0.0, []
    h_end = 0.0
    for k in range(steps):
        if overlap:
            h0 = max(h_end, g_end[k - 2] if k >= 2 else 0.0)
            h_end = h0 + host_ms
            g0 = max(h_end, g_end[k - 1] if k >= 1 else 0.0)
        else:
            h0, h_end = t, t + host_ms
            g0 = h_end
        g_end.append(g0 + gpu_ms)
        t = g_end[-1]
        spans += [("host", k, h0, h_end), ("GPU", k, g0, g_end[-1])]
    return spans


def draw_overlap(host_ms: float, gpu_ms: float, steps: int = 5, title: str | None = None):
    """Host and GPU lanes for `steps` decode steps, in turn (top) and overlapped (bottom)."""
    fig, axes = plt.subplots(2, 1, figsize=(10, 3.6), sharex=True)
    for ax, overlap in zip(axes, (False, True)):
        spans = overlap_schedule(host_ms, gpu_ms, steps, overlap)
        end = max(s[3] for s in spans)
        for lane, k, a, b in spans:
            y = 1 if lane == "host" else 0
            ax.add_patch(Rectangle((a, y + 0.1), b - a, 0.8, facecolor=request_color(k),
                                   edgecolor="black", linewidth=0.5))
            if b - a > 0.04 * end:
                ax.text((a + b) / 2, y + 0.5, str(k + 1), ha="center", va="center", fontsize=8)
        ax.set_yticks([0.5, 1.5], ["GPU", "host"])
        ax.set_ylim(0, 2)
        ax.set_xlim(0, max(s[3] for s in overlap_schedule(host_ms, gpu_ms, steps, False)) * 1.02)
        ax.set_title(f"{'overlapped: step n+1 launched before step n is read' if overlap else 'in turn'}"
                     f" -- {steps} tokens in {end:.2f} ms = {steps / end * 1e3:,.0f} tokens/s",
                     fontsize=9, loc="left")
    axes[1].set_xlabel("ms")
    fig.suptitle(title or f"host {host_ms:.2f} ms + GPU {gpu_ms:.2f} ms per step", fontsize=10)
    fig.tight_layout()
    return fig
