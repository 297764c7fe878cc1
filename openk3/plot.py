"""Dependency-free PNG charts (standard library only): a raster `Canvas` with a 5x7 bitmap font, number and
byte formatters, and `line_chart` (axes, grid, ticks, lines, stacked areas, dashed reference lines, legend).

Shared by the trainer's loss.png (openk3/train/metrics.py) and torch-free commands such as `openk3 plan`.
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Color = tuple[int, int, int]
Point = tuple[float, float]

# 5x7 bitmap font: rows top to bottom as hex bytes (5 bits, MSB = left). Glyphs with a descender
# (g j p q y , ; _) have 8-9 rows: rows 7-8 hang below the baseline. Anything else draws as "?".
_FONT_HEX = {
    'A': "0e11111f111111", 'B': "1e11111e11111e", 'C': "0e11101010110e", 'D': "1e11111111111e",
    'E': "1f10101e10101f", 'F': "1f10101e101010", 'G': "0e11101711110f", 'H': "1111111f111111",
    'I': "0e04040404040e", 'J': "0702020202120c", 'K': "11121418141211", 'L': "1010101010101f",
    'M': "111b1515111111", 'N': "11111915131111", 'O': "0e11111111110e", 'P': "1e11111e101010",
    'Q': "0e11111115120d", 'R': "1e11111e141211", 'S': "0f10100e01011e", 'T': "1f040404040404",
    'U': "1111111111110e", 'V': "11111111110a04", 'W': "1111111515150a", 'X': "11110a040a1111",
    'Y': "11110a04040404", 'Z': "1f01020408101f", 'a': "00000e010f110f", 'b': "1010161911111e",
    'c': "00000e1010110e", 'd': "01010d1311110f", 'e': "00000e111f100e", 'f': "0609081c080808",
    'g': "00000f1111110f010e", 'h': "10101619111111", 'i': "04000c0404040e", 'j': "02000602020202120c",
    'k': "10101214181412", 'l': "0c04040404040e", 'm': "00001a15151111", 'n': "00001619111111",
    'o': "00000e1111110e", 'p': "00001e1111111e1010", 'q': "00000f1111110f0101", 'r': "00001619101010",
    's': "00000e100e011e", 't': "08081c08080906", 'u': "0000111111130d", 'v': "00001111110a04",
    'w': "0000111115150a", 'x': "0000110a040a11", 'y': "0000111111110f010e", 'z': "00001f0204081f",
    '0': "0e11131519110e", '1': "040c040404040e", '2': "0e11010204081f", '3': "1f02040201110e",
    '4': "02060a121f0202", '5': "1f101e0101110e", '6': "0608101e11110e", '7': "1f010204080808",
    '8': "0e11110e11110e", '9': "0e11110f01020c", ' ': "00000000000000", '.': "00000000000c0c",
    ',': "00000000000c0c0408", ':': "000c0c000c0c00", ';': "000c0c000c0c0408", '-': "0000001f000000",
    '+': "0004041f040400", '_': "000000000000001f", '/': "00010204081000", '(': "02040808080402",
    ')': "08040202020408", '[': "0e08080808080e", ']': "0e02020202020e", '%': "18190204081303",
    '=': "00001f001f0000", '<': "02040810080402", '>': "08040201020408", '*': "0004150e150400",
    "'": "04040800000000", '|': "04040404040404", '#': "0a0a1f0a1f0a0a", '&': "0c12140815120d",
    '?': "0e110102040004", '!': "04040404040004", '"': "0a0a0a00000000", '$': "040f140e051e04",
    '@': "0e11010d15150e", '\\': "00100804020100", '^': "040a1100000000", '`': "08040200000000",
    '{': "02040408040402", '}': "08040402040408", '~': "00000815020000",
}
GLYPHS: dict[str, tuple[int, ...]] = {
    ch: tuple(int(h[i:i + 2], 16) for i in range(0, len(h), 2)) for ch, h in _FONT_HEX.items()
}
GLYPH_W, GLYPH_H, ADVANCE = 5, 7, 6  # cap height 7 px (+2 for descenders), 1 px between glyphs, at scale 1

PALETTE: tuple[Color, ...] = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
                              (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207))
WHITE, BLACK, GRID = (255, 255, 255), (0, 0, 0), (230, 230, 230)


def lighter(c: Color, f: float = 0.55) -> Color:
    """`c` moved a fraction `f` towards white (the fill of a `Series` with `fill_to`)."""
    return tuple(round(v + (255 - v) * f) for v in c)


def text_width(s: str, scale: int = 1) -> int:
    return max(0, len(s) * ADVANCE * scale - scale)


class Canvas:
    """An RGB raster (white by default); coordinates are pixel indices, (0, 0) top left, drawing clips."""

    def __init__(self, w: int, h: int, bg: Color = WHITE) -> None:
        self.w, self.h, self.bg = w, h, tuple(bg)
        self.px = bytearray(bytes(bg) * (w * h))

    def set(self, x: int, y: int, c: Color) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i:i + 3] = bytes(c)

    def get(self, x: int, y: int) -> Color:
        i = 3 * (y * self.w + x)
        return tuple(self.px[i:i + 3])

    def line(self, x0: int, y0: int, x1: int, y1: int, c: Color, width: int = 1) -> None:
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for ox in range(width):
                for oy in range(width):
                    self.set(x0 + ox - width // 2, y0 + oy - width // 2, c)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def dashed(self, x0: int, y0: int, x1: int, y1: int, c: Color, width: int = 1, dash: int = 8,
               gap: int = 5) -> None:
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(0, n + 1, dash + gap):
            j = min(i + dash - 1, n)
            self.line(x0 + round((x1 - x0) * i / n), y0 + round((y1 - y0) * i / n),
                      x0 + round((x1 - x0) * j / n), y0 + round((y1 - y0) * j / n), c, width)

    def dot(self, x: int, y: int, c: Color, r: int = 2) -> None:
        for ox in range(-r, r + 1):
            for oy in range(-r, r + 1):
                if ox * ox + oy * oy <= r * r:
                    self.set(x + ox, y + oy, c)

    def rect(self, x0: int, y0: int, x1: int, y1: int, c: Color) -> None:
        """Fill the rectangle with corners (x0, y0) and (x1, y1), both included."""
        x0, x1 = max(0, min(x0, x1)), min(self.w - 1, max(x0, x1))
        y0, y1 = max(0, min(y0, y1)), min(self.h - 1, max(y0, y1))
        if x1 < x0:
            return
        run = bytes(c) * (x1 - x0 + 1)
        for y in range(y0, y1 + 1):
            i = 3 * (y * self.w + x0)
            self.px[i:i + len(run)] = run

    def polygon(self, pts: Sequence[Point], c: Color) -> None:
        """Fill a polygon (even-odd rule; float vertices allowed) by scanlines through pixel centres."""
        pts = [(float(x), float(y)) for x, y in pts]
        if len(pts) < 3:
            return
        edges = list(zip(pts, pts[1:] + pts[:1]))
        ys = [y for _, y in pts]
        for y in range(max(0, math.ceil(min(ys))), min(self.h - 1, math.floor(max(ys))) + 1):
            xs = sorted(xa + (y - ya) * (xb - xa) / (yb - ya) for (xa, ya), (xb, yb) in edges if (ya <= y) != (yb <= y))
            for a, b in zip(xs[::2], xs[1::2]):
                self.rect(math.ceil(a), y, math.floor(b), y, c)

    def fill_between(self, upper: Sequence[Point], lower: Sequence[Point], c: Color) -> None:
        """Fill the area between two polylines (e.g. two cumulative sums of a stacked chart)."""
        self.polygon(list(upper) + list(reversed(lower)), c)

    def text(self, x: int, y: int, s: str, c: Color = BLACK, scale: int = 1, vertical: bool = False) -> int:
        """Draw `s` with its cap-height box's top-left at (x, y); `vertical` turns it 90 degrees
        anticlockwise, reading upwards from (x, y) = the bottom-left. Returns the width drawn."""
        for k, ch in enumerate(s):
            for r, bits in enumerate(GLYPHS.get(ch, GLYPHS["?"])):
                for col in range(GLYPH_W):
                    if bits >> (GLYPH_W - 1 - col) & 1:
                        u, v = (k * ADVANCE + col) * scale, r * scale
                        if vertical:
                            self.rect(x + v, y - u - scale + 1, x + v + scale - 1, y - u, c)
                        else:
                            self.rect(x + u, y + v, x + u + scale - 1, y + v + scale - 1, c)
        return text_width(s, scale)

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[3 * y * self.w: 3 * (y + 1) * self.w]) for y in range(self.h))

        def chunk(tag: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

        header = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)  # 8-bit RGB
        body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")
        return b"\x89PNG\r\n\x1a\n" + body

    def save(self, path: str | os.PathLike) -> None:
        write_atomic(path, self.png())


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` via a temporary file and os.replace (readers never see a partial file)."""
    tmp = f"{os.fspath(path)}.tmp"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ---- formatting ---------------------------------------------------------------------------------------

def format_number(v: float) -> str:
    """Short axis label: 3 significant digits in [0.01, 10000), else 1.2e04 style."""
    if v == 0 or 0.01 <= abs(v) < 10000:
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return f"{v:.1e}".replace("+", "")


def format_bytes(v: float) -> str:
    """Decimal units with 3 significant digits: 512 B, 1.5 KB, 414 MB, 12.3 GB, 1.5 TB."""
    if not math.isfinite(v):
        return f"{v} B"
    a, units = abs(v), ("B", "KB", "MB", "GB", "TB")
    i = 0
    while i < len(units) - 1 and float(f"{a / 1000 ** i:.3g}") >= 1000:
        i += 1
    x = a / 1000 ** i
    s = f"{x:.0f}" if x >= 1000 else f"{x:.3g}"
    return f"{'-' if v < 0 else ''}{s} {units[i]}"


# ---- line charts ----------------------------------------------------------------------------------------

@dataclass
class Series:
    """One line. With `fill_to` (another polyline, e.g. the previous cumulative sum) the area between
    `fill_to` and `points` is filled with a lighter shade of the colour."""

    label: str
    points: list[tuple[float, float]]
    color: tuple[int, int, int] | None = None
    fill_to: list[tuple[float, float]] | None = None


def _valid(v: float, log: bool) -> bool:
    return math.isfinite(v) and (v > 0 or not log)


def _linear_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """n evenly spaced round ticks (step 1, 2, 2.5 or 5 x 10^k) covering [lo, hi]."""
    if hi - lo <= 1e-12 * max(abs(lo), abs(hi)):
        d = abs(lo) * 0.5 or 1.0
        lo, hi = lo - d, hi + d
    mag = 10.0 ** math.floor(math.log10((hi - lo) / (n - 1)))
    for m in (1, 2, 2.5, 5, 10, 20):
        step = m * mag
        start = math.floor(lo / step + 1e-9) * step
        if start + (n - 1) * step >= hi - 1e-9 * step:
            break
    return [start + i * step for i in range(n)]


def _log_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Powers of 2 when both ends are powers of 2 (and not of 10), else powers of 10 (with 2x/5x or 3x
    between them over one or two decades); every k-th power so that there are at most n+1."""
    def is_pow(v: float, b: int) -> bool:
        e = round(math.log(v, b))
        return abs(b ** e - v) <= 1e-9 * v

    base = 2 if is_pow(lo, 2) and is_pow(hi, 2) and not (is_pow(lo, 10) and is_pow(hi, 10)) else 10
    a = math.floor(math.log(lo, base) + 1e-9)
    b = max(math.ceil(math.log(hi, base) - 1e-9), a + 1)
    if base == 10 and b - a <= 2:
        mults = (1, 2, 5) if b - a == 1 else (1, 3)
        return [m * 10.0 ** e for e in range(a, b) for m in mults] + [10.0 ** b]
    k = math.ceil((b - a) / n)
    return [float(base) ** e for e in range(a, a + math.ceil((b - a) / k) * k + 1, k)]


def _ticks(values: list[float], log: bool) -> list[float]:
    if not values:
        return _log_ticks(1, 10) if log else _linear_ticks(0, 1)
    return (_log_ticks if log else _linear_ticks)(min(values), max(values))


def chart_png(series: Sequence[Series], *, title: str = "", x_label: str = "", y_label: str = "",
              hlines: Sequence[tuple[str, float, Color | None]] = (), x_log: bool = False, y_log: bool = False,
              width: int = 800, height: int = 480, x_format: Callable[[float], str] = format_number,
              y_format: Callable[[float], str] = format_number) -> bytes:
    """PNG bytes of a line chart; see `line_chart`."""
    colors = [s.color or PALETTE[i % len(PALETTE)] for i, s in enumerate(series)]
    hl = [(lab, y, c or (90, 90, 90)) for lab, y, c in hlines if _valid(y, y_log)]
    polys = [list(s.points) + list(s.fill_to or []) for s in series]
    xs = [x for pts in polys for x, y in pts if _valid(x, x_log) and _valid(y, y_log)]
    ys = [y for pts in polys for x, y in pts if _valid(x, x_log) and _valid(y, y_log)] + [y for _, y, _ in hl]
    xt, yt = _ticks(xs, x_log), _ticks(ys, y_log)
    xl, yl = [x_format(v) for v in xt], [y_format(v) for v in yt]

    c = Canvas(width, height)
    left = 12 + (16 if y_label else 0) + max(text_width(s) for s in yl) + 8
    top = 12 + (26 if title else 0)
    right = max(20, text_width(xl[-1]) // 2 + 8)
    bottom = 8 + 6 + 9 + (20 if x_label else 0)
    pw, ph = width - left - right, height - top - bottom
    tx = math.log10 if x_log else float
    ty = math.log10 if y_log else float
    x0, x1, y0, y1 = tx(xt[0]), tx(xt[-1]), ty(yt[0]), ty(yt[-1])

    def X(v: float) -> float:
        return left + (tx(v) - x0) / (x1 - x0) * pw

    def Y(v: float) -> float:
        return top + (y1 - ty(v)) / (y1 - y0) * ph

    def pixels(pts: Sequence[Point], clamp: bool = False) -> list[tuple[float, float] | None]:
        """Mapped points, None where a value can't be drawn; with `clamp`, y <= 0 on a log axis sits on the
        bottom edge (the floor of a stacked area)."""
        out = []
        for x, y in pts:
            if clamp and y_log and _valid(x, x_log) and math.isfinite(y) and y <= 0:
                out.append((X(x), top + ph))
            else:
                out.append((X(x), Y(y)) if _valid(x, x_log) and _valid(y, y_log) else None)
        return out

    for v in xt:  # grid
        c.line(round(X(v)), top, round(X(v)), top + ph, GRID)
    for v in yt:
        c.line(left, round(Y(v)), left + pw, round(Y(v)), GRID)
    for s, col in zip(series, colors):  # areas first, lines over them
        if s.fill_to is not None:
            upper = [p for p in pixels(s.points) if p]
            lower = [p for p in pixels(s.fill_to, clamp=True) if p]
            c.fill_between(upper, lower, lighter(col))
    for _, y, col in hl:
        c.dashed(left, round(Y(y)), left + pw, round(Y(y)), col, width=2)
    for s, col in zip(series, colors):
        pts = pixels(s.points)
        for i, p in enumerate(pts):
            if p is None:
                continue
            q = pts[i + 1] if i + 1 < len(pts) else None
            if q is not None:
                c.line(round(p[0]), round(p[1]), round(q[0]), round(q[1]), col, width=2)
            elif i == 0 or pts[i - 1] is None:  # an isolated point
                c.dot(round(p[0]), round(p[1]), col, r=2)
    c.line(left, top, left, top + ph, BLACK)  # axes, ticks, labels
    c.line(left, top + ph, left + pw, top + ph, BLACK)
    for v, s in zip(xt, xl):
        x = round(X(v))
        c.line(x, top + ph, x, top + ph + 4, BLACK)
        c.text(x - text_width(s) // 2, top + ph + 8, s)
    for v, s in zip(yt, yl):
        y = round(Y(v))
        c.line(left - 4, y, left, y, BLACK)
        c.text(left - 8 - text_width(s), y - 3, s)
    if title:
        c.text(max(4, left + (pw - text_width(title, 2)) // 2), 12, title, scale=2)
    if x_label:
        c.text(left + (pw - text_width(x_label)) // 2, height - 16, x_label)
    if y_label:
        c.text(10, top + (ph + text_width(y_label)) // 2, y_label, vertical=True)
    _legend(c, [(s.label, col, s.fill_to is not None, False) for s, col in zip(series, colors)]
            + [(lab, col, False, True) for lab, _, col in hl], left, top, pw, ph)
    return c.png()


def _legend(c: Canvas, entries: list[tuple[str, Color, bool, bool]], left: int, top: int, pw: int, ph: int) -> None:
    """A boxed legend (swatch + label per entry) in the plot corner covering the fewest drawn pixels."""
    entries = [e for e in entries if e[0]]
    if not entries:
        return
    w, h = 8 + 20 + 6 + max(text_width(e[0]) for e in entries) + 8, 6 + 13 * len(entries) + 1
    corners = [(left + pw - w - 8, top + 8), (left + 8, top + 8), (left + pw - w - 8, top + ph - h - 8),
               (left + 8, top + ph - h - 8)]

    def ink(x: int, y: int) -> int:
        return sum(c.get(i, j) not in (WHITE, GRID) for j in range(max(y, 0), min(y + h, c.h))
                   for i in range(max(x, 0), min(x + w, c.w)))

    x, y = min(corners, key=lambda p: ink(*p))
    c.rect(x, y, x + w - 1, y + h - 1, (160, 160, 160))
    c.rect(x + 1, y + 1, x + w - 2, y + h - 2, WHITE)
    for k, (label, col, area, dashed) in enumerate(entries):
        ry = y + 6 + 13 * k
        if area:
            c.rect(x + 8, ry, x + 27, ry + 6, lighter(col))
        if dashed:
            c.dashed(x + 8, ry + 3, x + 27, ry + 3, col, width=2, dash=6, gap=3)
        else:
            c.line(x + 8, ry + 3, x + 27, ry + 3, col, width=2)
        c.text(x + 34, ry, label)


def line_chart(path: str | os.PathLike, series: Sequence[Series], *, title: str = "", x_label: str = "",
               y_label: str = "", hlines: Sequence[tuple[str, float, Color | None]] = (), x_log: bool = False,
               y_log: bool = False, width: int = 800, height: int = 480,
               x_format: Callable[[float], str] = format_number,
               y_format: Callable[[float], str] = format_number) -> None:
    """Write (atomically) a PNG line chart of `series`: axes, light grid, ~5 ticks per axis (log axes at
    powers of 10 or 2; values a log axis can't show are skipped), 2 px lines in the palette unless a series
    has a colour, filled areas for series with `fill_to`, `hlines` = (label, y, colour) dashed horizontal
    lines, a legend of every label, the title on top and axis labels."""
    write_atomic(path, chart_png(series, title=title, x_label=x_label, y_label=y_label, hlines=hlines,
                                 x_log=x_log, y_log=y_log, width=width, height=height, x_format=x_format,
                                 y_format=y_format))
