"""The drawings' house style: one colour per request (the same in every panel), the colours of
idle slots, free, shared and cached blocks, text that reads on any colour, the tidy frame every
drawing ends with, and a figure as PNG bytes. Every drawing of the course imports it."""
from __future__ import annotations

import io
import os

import matplotlib

if os.environ.get("MPLBACKEND") is None and "ipykernel" not in __import__("sys").modules:
    matplotlib.use("Agg")          # scripts and tests: no display needed

import matplotlib.pyplot as plt  # noqa: E402


IDLE = "#f2f2f2"


FREE = "#ffffff"


SHARED = "#ffd24d"        # a block held by several requests (prefix caching): same colour in every row


CACHED = "#e3e3e3"        # a block nobody holds that keeps a cached prefix


MISSING = "#d9d9d9"       # past the end of the pool (only there to fill the grid): hatched grey


PREEMPT = "#d62728"       # the preemption marker


def _make_palette(n: int = 64) -> list:
    """n colours, all different and none close to another or to the idle/free/shared colours:
    tab10 first (the familiar ones), then other qualitative matplotlib maps, pale and grey ones out."""
    import colorsys

    import matplotlib.colors as mc
    taken = [mc.to_rgb(c) for c in (IDLE, SHARED, CACHED, MISSING)]
    out = []
    for name in ("tab10", "tab20b", "tab20c", "Dark2", "Set1", "Paired", "Set2", "Accent", "tab20"):
        cs = list(plt.get_cmap(name).colors)
        if name in ("tab20b", "tab20c"):        # 5 hues x 4 shades: hues first, so neighbours differ
            cs = [cs[4 * h + k] for k in range(4) for h in range(len(cs) // 4)]
        for c in cs:
            rgb = mc.to_rgb(c)
            _, light, sat = colorsys.rgb_to_hls(*rgb)
            if sat < 0.25 or light > 0.9:
                continue
            if any(sum(abs(a - b) for a, b in zip(rgb, t)) < 0.12 for t in taken + out):
                continue
            out.append(rgb)
    return [mc.to_hex(c) for c in out[:n]]


PALETTE = _make_palette()


NUM_COLORS = len(PALETTE)   # request ids 0..63 all get their own colour; then they repeat (the
                             # number printed on the cells tells requests apart)


def request_color(rid):
    """The colour of request `rid`: the same in every panel; distinct for ids 0..NUM_COLORS-1, then
    it repeats every NUM_COLORS ids (req 64 looks like req 0: read the number on the cell)."""
    if rid is None:
        return IDLE
    return PALETTE[rid % NUM_COLORS]


def req_name(rid) -> str:
    """The one name a request has in every drawing: 'req 7'."""
    return f"req {rid}"


def ink(color) -> str:
    """Black or white text, whichever reads better on `color`."""
    import matplotlib.colors as mc
    r, g, b = mc.to_rgb(color)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"


def tidy(fig, ax, tight: bool = True):
    """The house style every drawing ends with: no top/right frame; tight layout for own figures."""
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if tight:
        fig.tight_layout()
    return fig


def new_ax(ax, figsize):
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize)
        return fig, ax
    return ax.figure, ax


def fig_to_png(fig, dpi: int = 80, bbox_inches="tight", colors: int | None = None) -> bytes:
    """The figure as PNG bytes. bbox_inches: "tight" (crop to what is drawn), None (the whole
    figure) or a Bbox in inches (the same crop for every frame of an animation). colors: reduce
    to a palette of that many colours (<= 256): the drawings are flat colours, so a 256-colour
    PNG looks the same and is about 3x smaller."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches=bbox_inches)
    if colors is None:
        return buf.getvalue()
    from PIL import Image
    img = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    out = io.BytesIO()
    img.quantize(colors=colors, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(out, format="PNG")
    return out.getvalue()
