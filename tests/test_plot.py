"""openk3.plot: the PNG writer (decoded back here), the bitmap font, line charts, formatters, no torch."""

from __future__ import annotations

import math
import string
import struct
import subprocess
import sys
import zlib

import pytest

from openk3.plot import (
    GLYPHS,
    PALETTE,
    Canvas,
    Series,
    chart_png,
    format_bytes,
    format_number,
    lighter,
    line_chart,
    text_width,
)

SIG = b"\x89PNG\r\n\x1a\n"
FONT_SET = string.ascii_letters + string.digits + " .,:;-+_/()[]%=<>x*'|#&?"


def decode(png: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes) of an 8-bit RGB PNG whose scanlines all use filter 0."""
    assert png[:8] == SIG
    pos, idat, w = 8, b"", None
    while pos < len(png):
        n, tag = struct.unpack(">I4s", png[pos:pos + 8])
        data = png[pos + 8:pos + 8 + n]
        assert struct.unpack(">I", png[pos + 8 + n:pos + 12 + n])[0] == zlib.crc32(tag + data) & 0xFFFFFFFF
        if tag == b"IHDR":
            w, h, depth, ctype, _, _, _ = struct.unpack(">IIBBBBB", data)
            assert (depth, ctype) == (8, 2)
        elif tag == b"IDAT":
            idat += data
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = 1 + 3 * w
    assert len(raw) == stride * h
    assert all(raw[y * stride] == 0 for y in range(h))
    return w, h, [raw[y * stride + 1:(y + 1) * stride] for y in range(h)]


def colors(png: bytes) -> set[tuple[int, int, int]]:
    _, _, rows = decode(png)
    return {tuple(row[i:i + 3]) for row in rows for i in range(0, len(row), 3)}


LINE = [(1.0, 2.0), (2.0, 4.0), (3.0, 3.0), (4.0, 6.0)]


def test_png_signature_and_size():
    png = chart_png([Series("a", LINE)], width=321, height=207)
    assert png[:8] == SIG and png[12:16] == b"IHDR"
    assert struct.unpack(">II", png[16:24]) == (321, 207)
    w, h, rows = decode(png)
    assert (w, h, len(rows)) == (321, 207, 207)


def test_series_colours():
    png = chart_png([Series("mine", LINE, color=(10, 200, 30)), Series("default", [(x, y + 1) for x, y in LINE])])
    cs = colors(png)
    assert (10, 200, 30) in cs and PALETTE[1] in cs


def test_filled_area_uses_lighter_colour():
    col = (200, 40, 120)
    base = [(x, 0.0) for x, _ in LINE]
    assert lighter(col) not in colors(chart_png([Series("line", LINE, color=col)]))
    cs = colors(chart_png([Series("area", LINE, color=col, fill_to=base)]))
    assert col in cs and lighter(col) in cs


def test_hline_colour_and_range():
    cs = colors(chart_png([Series("a", LINE)], hlines=[("limit", 100.0, (5, 6, 250))]))
    assert (5, 6, 250) in cs  # drawn even though far above the data (the y range grows to include it)


def test_glyphs_render_and_differ():
    def draw(s: str, scale: int = 1) -> bytes:
        c = Canvas(16, 16)
        c.text(2, 2, s, scale=scale)
        return bytes(c.px)

    blank = bytes(Canvas(16, 16).px)
    assert draw("A") != draw("B")
    seen = {}
    for ch in dict.fromkeys(FONT_SET):  # "x" is listed twice (letter and times sign)
        img = draw(ch)
        assert (img == blank) == (ch == " "), repr(ch)
        assert img not in seen, f"{ch!r} looks like {seen.get(img)!r}"
        seen[img] = ch
    assert draw("\u00e9") == draw("?") and draw("\t") == draw("?")  # fallback
    assert set(FONT_SET) <= set(GLYPHS)
    assert text_width("abc") == 17 and text_width("abc", 2) == 34 and text_width("") == 0


def test_text_scale_and_vertical():
    c = Canvas(40, 40)
    assert c.text(0, 0, "I", scale=2) == 10
    assert c.get(2, 0) == (0, 0, 0) and c.get(3, 1) == (0, 0, 0)  # the 2x2 block of the top bar's first pixel
    v = Canvas(40, 40)
    v.text(0, 39, "L", vertical=True)  # reads upwards: the stem lies along the bottom row, the foot at x=6
    assert v.get(0, 39) == (0, 0, 0) and v.get(6, 39) == (0, 0, 0) and v.get(6, 35) == (0, 0, 0)


def test_rect_and_polygon():
    c = Canvas(20, 20)
    c.rect(15, 12, 5, 2, (1, 2, 3))
    assert c.get(5, 2) == c.get(15, 12) == (1, 2, 3) and c.get(4, 2) == c.get(16, 12) == (255, 255, 255)
    c.rect(-5, -5, 100, 0, (9, 9, 9))  # clipped
    assert c.get(0, 0) == c.get(19, 0) == (9, 9, 9)
    p = Canvas(20, 20)
    p.fill_between([(0, 5), (19, 5)], [(0, 15), (19, 15)], (7, 7, 7))
    assert p.get(10, 10) == (7, 7, 7) and p.get(10, 3) == (255, 255, 255) and p.get(10, 17) == (255, 255, 255)


def test_log_axes_skip_bad_values():
    good = [(1.0, 1.0), (10.0, 10.0), (100.0, 100.0)]
    bad = [(0.0, 5.0), (-3.0, 2.0)] + good + [(1000.0, -3.0), (2000.0, 0.0), (math.nan, 2.0), (50.0, math.inf)]
    kw = dict(x_log=True, y_log=True, hlines=[("zero", 0.0, (1, 1, 1)), ("ten", 10.0, (2, 2, 2))])
    assert chart_png([Series("s", bad)], **kw) == chart_png([Series("s", good)], **kw)
    # nothing drawable at all, an area whose floor is 0 on a log axis: no crash
    decode(chart_png([Series("none", [(0.0, -1.0), (math.nan, 1.0)])], x_log=True, y_log=True))
    col = (0, 128, 255)
    area = chart_png([Series("area", good, color=col, fill_to=[(x, 0.0) for x, _ in good])], x_log=True, y_log=True)
    assert lighter(col) in colors(area)
    decode(chart_png([], x_log=True))
    decode(chart_png([Series("flat", [(1.0, 3.0), (2.0, 3.0)])]))


def test_line_chart_atomic(tmp_path):
    path = tmp_path / "chart.png"
    kw = dict(title="Memory vs context", x_label="context", y_label="bytes", x_log=True, y_format=format_bytes,
              hlines=[("8x H100 memory", 640e9, (0, 0, 0))])
    series = [Series("weights", [(1024.0, 1e11), (2.0 ** 20, 1e11)], fill_to=[(1024.0, 0.0), (2.0 ** 20, 0.0)])]
    line_chart(path, series, **kw)
    assert [p.name for p in tmp_path.iterdir()] == ["chart.png"]
    assert path.read_bytes() == chart_png(series, **kw)
    line_chart(str(path), series, **kw)  # overwrite, str path
    assert [p.name for p in tmp_path.iterdir()] == ["chart.png"]


@pytest.mark.parametrize("v,s", [(0, "0 B"), (999, "999 B"), (1000, "1 KB"), (1500, "1.5 KB"), (414e6, "414 MB"),
                                 (12_345_678_901, "12.3 GB"), (999.6e9, "1 TB"), (1.5e12, "1.5 TB"),
                                 (2.5e15, "2500 TB"), (-2e9, "-2 GB")])
def test_format_bytes(v, s):
    assert format_bytes(v) == s


@pytest.mark.parametrize("v,s", [(0, "0"), (3.14159, "3.14"), (250.4, "250"), (12345, "1.2e04"), (0.001, "1.0e-03"),
                                 (-7.5, "-7.5")])
def test_format_number(v, s):
    assert format_number(v) == s


def test_plot_losses_draws_with_plot(tmp_path):
    from openk3.train.metrics import TRAIN_COLOR, VAL_COLOR, plot_losses

    path = tmp_path / "loss.png"
    plot_losses({s: 5.0 / s for s in range(1, 50)}, {10: 0.6, 40: 0.2}, str(path))
    png = path.read_bytes()
    assert struct.unpack(">II", png[16:24]) == (640, 400)
    assert {TRAIN_COLOR, VAL_COLOR, (0, 0, 0)} <= colors(png)
    assert [p.name for p in tmp_path.iterdir()] == ["loss.png"]


def test_import_does_not_load_torch():
    code = "import sys, openk3.plot; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
