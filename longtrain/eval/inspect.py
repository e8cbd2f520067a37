"""What the SparseK pool keeps: per-token selection scores and the pool at the end of a text.

`selection_map` reads a text through a trained model chunk by chunk (its cache carried, as in
training) and records, per selecting layer, every token's score u and which tokens sit in the pool
after the last token (the keys the next token would see beyond its window). `render_html` and
`render_png` draw it like the paper's visualisation: each token shaded by its score, pool tokens
boxed, the window's tokens underlined; one panel per layer.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from longtrain.errors import InspectError  # noqa: F401  (raised here; defined with the others)

PNG_MAX_ROWS = 1500  # text rows over all panels; a larger PNG is unreadable (use HTML or --layer)
PNG_COLS = 100  # characters per row in the PNG
MAX_TOKENS = 20_000  # tokens read by default: about 0.4 KB of HTML per token and layer, a second or two per layer on a CPU


@dataclass
class SelectionMap:
    text: str
    spans: list[tuple[int, int]]  # per token, its characters [start, end) in text
    layers: list[int]  # the layers shown
    u: np.ndarray  # [layers, T] float64 selection score of every token (mean over score groups)
    in_pool: np.ndarray  # [layers, T] bool: in the pool after the last token (any score group)
    topk: int
    window: int
    eps_slope: float

    @property
    def n_tokens(self) -> int:
        return len(self.spans)

    def in_window(self) -> np.ndarray:
        """[T] bool: the last w tokens, which the next token sees through its window."""
        mask = np.zeros(self.n_tokens, dtype=bool)
        if self.window:
            mask[-self.window :] = True
        return mask


def selecting_layers(model) -> list[int]:
    return [i for i, blk in enumerate(model.blocks) if blk.attn.topk > 0]


def read_text(raw: bytes, name: str, *, cut: bool = False) -> str:
    """The file's bytes as text; InspectError for a binary or non-UTF-8 file (before any model work).
    cut: `raw` is the start of a longer file, so a character its end splits is dropped."""
    nul = raw.find(b"\x00")
    if nul >= 0:
        raise InspectError(
            f"{name} holds NUL bytes (the first at byte {nul:,}): it is a binary file, not text; "
            "give a UTF-8 text file", arg="text",
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if cut and e.reason == "unexpected end of data":
            return read_text(raw[: e.start], name)
        raise InspectError(
            f"{name} is not UTF-8 text (byte {e.start:,} is {raw[e.start:e.start + 1]!r}); "
            "give a UTF-8 text file (convert it first, e.g. iconv -t UTF-8)", arg="text",
        ) from None
    if not text.strip():
        raise InspectError(f"{name} is empty: give a text with some words in it", arg="text")
    return text


def first_tokens(tokenizer, text: str, max_tokens: int) -> tuple[str, int]:
    """(the text up to the end of its `max_tokens`-th token, the text's token count).

    Only the first 32 characters per allowed token are tokenized, so a huge file costs no more than a
    long enough prefix; the count is then a lower bound (the caller says "more than")."""
    head = text[: 32 * max_tokens]
    offsets = tokenizer.encode(head, add_special_tokens=False).offsets
    if len(offsets) <= max_tokens:
        return head, len(offsets)
    return head[: offsets[max_tokens - 1][1]], len(offsets)


def check_png_size(text: str, n_layers: int, *, layer_given: bool) -> None:
    """Refuse a PNG taller than PNG_MAX_ROWS text rows over its panels (checked before the model pass)."""
    rows = len(_grid(text, PNG_COLS)[0])
    total = rows * n_layers
    if total <= PNG_MAX_ROWS:
        return
    fixes = ["a shorter text (or a smaller --max-tokens)", "write HTML (--out FILE.html)"]
    if not layer_given and n_layers > 1:
        fixes.insert(0, "pick one layer with --layer")
    raise InspectError(
        f"the text makes {rows:,} rows of {PNG_COLS} characters per layer, {total:,} for {n_layers} layer(s): too tall "
        f"for a PNG (at most {PNG_MAX_ROWS:,}). " + ", ".join(fixes[:-1]) + f" or {fixes[-1]}."
    )


@torch.no_grad()
def selection_map(loaded, text: str, *, layer: int | None = None) -> SelectionMap:
    """Scores and final pool of `text` under a loaded checkpoint (`load_checkpoint(...)`), read in
    chunks of the recipe's train.chunk_size."""
    model, recipe = loaded.model, loaded.recipe
    cfg = model.cfg
    layers = selecting_layers(model)
    if not layers:
        raise InspectError(
            f"the checkpoint's attention is {cfg.attention!r}: it selects nothing, so there are no selection "
            "scores to show. Inspect a sparsek or sparsek+sw model."
        )
    if layer is not None:
        if not 0 <= layer < cfg.layers:
            raise InspectError(f"{layer} is out of range: the model has {cfg.layers} layers (0..{cfg.layers - 1})", arg="layer")
        layers = [layer]
    enc = loaded.tokenizer.encode(text, add_special_tokens=False)
    ids = enc.ids
    if not ids:
        raise InspectError("the text has no tokens (is the file empty?)")

    device = next(model.parameters()).device
    chunk = recipe.train.chunk_size
    tokens = torch.tensor([ids], dtype=torch.int64, device=device)
    cache = model.empty_cache(1, device=device, dtype=torch.float32)
    u_parts: list[list[torch.Tensor]] = [[] for _ in layers]
    model.eval()
    for o in range(0, len(ids), chunk):
        out = model.hidden(tokens[:, o : o + chunk], cache=cache)
        cache = out.cache
        for slot, i in enumerate(layers):
            u_parts[slot].append(out.selections[i].u.to(torch.float64).mean(0))  # [L]: groups averaged, on the device
    T = len(ids)
    u = torch.stack([torch.cat(parts) for parts in u_parts]).cpu().numpy()  # [layers, T]: one copy to the host
    in_pool = np.zeros((len(layers), T), dtype=bool)
    for slot, i in enumerate(layers):
        pos = cache.layers[i].attn.pool_pos.cpu().numpy().ravel()
        in_pool[slot, pos[pos >= 0]] = True
    spans = [(int(a), int(b)) for a, b in enc.offsets]
    return SelectionMap(
        text=text, spans=spans, layers=layers, u=u, in_pool=in_pool,
        topk=model.blocks[layers[0]].attn.topk, window=model.blocks[layers[0]].attn.window, eps_slope=cfg.eps_slope,
    )


def shade_values(sm: SelectionMap, without_slope: bool) -> np.ndarray:
    """[layers, T] in [0, 1]: each layer's scores scaled between its 2nd and 98th percentile."""
    u = sm.u - sm.eps_slope * np.arange(sm.n_tokens)[None] if without_slope else sm.u
    lo, hi = np.percentile(u, 2, axis=1, keepdims=True), np.percentile(u, 98, axis=1, keepdims=True)
    return np.clip((u - lo) / np.maximum(hi - lo, 1e-12), 0.0, 1.0)


def _colors(values: np.ndarray) -> np.ndarray:
    """RGB in [0, 1] for shades in [0, 1] (low: white, high: deep orange)."""
    from matplotlib import colormaps

    return colormaps["YlOrRd"](0.02 + 0.6 * values)[..., :3]  # light enough to read the text on


def _char_owner(sm: SelectionMap) -> np.ndarray:
    """[len(text)] the token covering each character (-1: none); later tokens win on overlaps."""
    owner = np.full(len(sm.text), -1, dtype=np.int64)
    for t, (a, b) in enumerate(sm.spans):
        owner[a:b] = t
    return owner


def _tokens(n: int) -> str:
    return f"{n:,} token" + ("" if n == 1 else "s")


def _boxed(sm: SelectionMap) -> str:
    """What the boxes show: the tokens the pool actually holds at the end (fewer than k, or none, in a short text)."""
    counts = sorted({int(n) for n in sm.in_pool.sum(1)})
    if counts == [0]:
        return (f"boxed: none, the pool holds no tokens yet at the end of these {_tokens(sm.n_tokens)} (it keeps up to "
                f"{sm.topk} of the tokens that have left the window)")
    held = _tokens(counts[0]) if len(counts) == 1 else f"{counts[0]:,}–{_tokens(counts[-1])}, per layer as its panel says"
    room = "" if counts[-1] >= sm.topk else f" (it holds up to {sm.topk})"
    return f"boxed: the {held} in the pool after the last token{room}"


def _legend(sm: SelectionMap, without_slope: bool) -> str:
    what = "u − ε·j (the scorer's part, without the position slope)" if without_slope else "u (the selection score)"
    window = (f"the last {_tokens(sm.window)} (the window)" if sm.n_tokens > sm.window else
              f"all {_tokens(sm.n_tokens)}, all in the window of {sm.window}")
    underlined = f"; underlined: {window}" if sm.window else ""
    return f"shade: {what}, per layer from its 2nd to its 98th percentile; {_boxed(sm)}{underlined}"


def render_html(sm: SelectionMap, path: Path, *, title: str, without_slope: bool = False) -> None:
    shades = shade_values(sm, without_slope)
    window = sm.in_window()
    owner = _char_owner(sm)
    panels = []
    for slot, layer in enumerate(sm.layers):
        rgb = (_colors(shades[slot]) * 255).round().astype(int)
        parts, t_prev, start = [], None, 0

        def flush(end: int) -> None:
            piece = html.escape(sm.text[start:end])
            if t_prev is None or t_prev < 0:
                parts.append(piece)
                return
            r, g, b = rgb[t_prev]
            cls = " ".join(c for c, on in (("pool", sm.in_pool[slot, t_prev]), ("win", window[t_prev])) if on)
            tip = f"token {t_prev} · u {sm.u[slot, t_prev]:.4f}" + (" · in pool" if sm.in_pool[slot, t_prev] else "")
            parts.append(f'<span class="{cls}" style="background:rgb({r},{g},{b})" title="{tip}">{piece}</span>')

        for c in range(len(sm.text) + 1):
            t = owner[c] if c < len(sm.text) else None
            if c == len(sm.text) or t != t_prev:
                if c > start:
                    flush(c)
                start, t_prev = c, t
        n_pool = int(sm.in_pool[slot].sum())
        panels.append(
            f"<section><h2>layer {layer}</h2><p class=meta>{_tokens(n_pool)} in the pool at the end</p>"
            f"<pre>{''.join(parts)}</pre></section>"
        )
    doc = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
pre {{ white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 13px; line-height: 1.7; }}
span.pool {{ outline: 2px solid #1f4fd1; outline-offset: -1px; }}
span.win {{ text-decoration: underline dotted #555; }}
.meta, .legend {{ color: #555; font-size: 13px; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p class=legend>{html.escape(_legend(sm, without_slope))}. Hover a token for its score.</p>
{''.join(panels)}
</body></html>
"""
    Path(path).write_text(doc, encoding="utf-8")


def _grid(text: str, cols: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Text wrapped into rows of `cols` characters: (rows, row of each char, col of each char; -1: not drawn)."""
    rows, row_of, col_of = [""], np.full(len(text), -1), np.full(len(text), -1)
    for i, ch in enumerate(text):
        if ch == "\n":
            rows.append("")
            continue
        if ch == "\r":  # CRLF files: the line break is the newline
            continue
        ch = " " if ch == "\t" or not ch.isprintable() else ch
        if len(rows[-1]) == cols:
            rows.append("")
        row_of[i], col_of[i] = len(rows) - 1, len(rows[-1])
        rows[-1] += ch
    return rows, row_of, col_of


def render_png(sm: SelectionMap, path: Path, *, title: str, without_slope: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.font_manager import FontProperties
    from matplotlib.patches import Rectangle
    from matplotlib.textpath import TextPath

    check_png_size(sm.text, len(sm.layers), layer_given=len(sm.layers) == 1)
    rows, row_of, col_of = _grid(sm.text, PNG_COLS)
    shades = shade_values(sm, without_slope)
    owner = _char_owner(sm)
    window = sm.in_window()
    font = FontProperties(family="DejaVu Sans Mono")

    def extent(n: int) -> float:
        return TextPath((0, 0), "x" * n, size=10, prop=font).get_extents().width

    advance = (extent(101) - extent(1)) / 1000  # points per character per point of font size
    dpi = 110
    # A whole number of pixels per character (about 9 points), so hinted glyphs stay on their cells.
    px = max(6, round(advance * 9 * dpi / 72))
    fs = px * 72 / (advance * dpi)
    cw, rh = px / dpi, 1.6 * fs / 72  # a character cell, in inches
    head = 0.45  # inches of panel title
    width = PNG_COLS * cw + 0.4
    height = sum(head + len(rows) * rh + 0.15 for _ in sm.layers) + 0.6
    fig = plt.figure(figsize=(width, height), dpi=dpi)
    fig.text(0.2 / width, 1 - 0.12 / height, title, fontsize=11, weight="bold", va="top")
    fig.text(0.2 / width, 1 - 0.38 / height, _legend(sm, without_slope), fontsize=7, va="top", color="#555", wrap=True)
    top = height - 0.6
    drawn = row_of >= 0
    for slot, layer in enumerate(sm.layers):
        h = len(rows) * rh
        ax = fig.add_axes([0.2 / width, (top - head - h) / height, PNG_COLS * cw / width, h / height])
        ax.set_title(f"layer {layer}: {_tokens(int(sm.in_pool[slot].sum()))} in the pool at the end", fontsize=9, loc="left")
        ax.set_xlim(0, PNG_COLS)
        ax.set_ylim(len(rows), 0)
        ax.axis("off")
        grid = np.ones((len(rows), PNG_COLS, 3))
        colors = _colors(shades[slot])
        has = drawn & (owner >= 0)
        grid[row_of[has], col_of[has]] = colors[owner[has]]
        ax.imshow(grid, extent=(0, PNG_COLS, len(rows), 0), aspect="auto", interpolation="nearest")
        for r, line in enumerate(rows):
            if line.strip():
                ax.text(0, r + 0.55, line, fontproperties=font, fontsize=fs, va="center", ha="left")
        for t in np.flatnonzero(sm.in_pool[slot] | window):
            a, b = sm.spans[t]
            chars = [c for c in range(a, b) if c < len(row_of) and row_of[c] >= 0]
            for r in sorted({int(row_of[c]) for c in chars}):
                cs = [int(col_of[c]) for c in chars if row_of[c] == r]
                if sm.in_pool[slot, t]:
                    ax.add_patch(Rectangle((min(cs), r + 0.05), max(cs) - min(cs) + 1, 0.9, fill=False, edgecolor="#1f4fd1", lw=1.6))
                else:
                    ax.plot([min(cs), max(cs) + 1], [r + 0.95, r + 0.95], color="#555", lw=0.8, ls=":")
        top -= head + h + 0.15
    fig.savefig(path)
    plt.close(fig)
