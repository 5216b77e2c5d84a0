"""A dependency-free PNG writer and the "error per layer" line chart of ``qattn eval``.

matplotlib is not a dependency of qattn, so the chart is drawn on an RGB raster here and
encoded with the standard library (``zlib`` + ``struct``): 8-bit RGB, filter 0 on every row,
one IDAT chunk. Text uses a built-in 5×7 bitmap font (digits, letters drawn upper-case, and
``. - _ : + ( ) / # = % , < >``), scaled by an integer factor.

- :func:`encode_png` / :func:`write_png`: raster -> PNG bytes / file.
- :class:`Canvas`: pixels, lines, rectangles and text.
- :func:`line_chart`: one series per label over the sites, log-scale y axis.
"""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

Color = tuple[int, int, int]

WHITE: Color = (255, 255, 255)
BLACK: Color = (0, 0, 0)
GRID: Color = (225, 225, 225)
AXIS: Color = (60, 60, 60)
PALETTE: tuple[Color, ...] = (
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207),
)
"""Series colours (the tab10 cycle), in order."""

# 5×7 glyphs: 7 rows of 5 bits, bit 4 (0x10) = leftmost column.
_FONT: dict[str, tuple[int, ...]] = {
    "0": (0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E), "1": (0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E),
    "2": (0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F), "3": (0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E),
    "4": (0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02), "5": (0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E),
    "6": (0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E), "7": (0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08),
    "8": (0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E), "9": (0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C),
    "A": (0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11), "B": (0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E),
    "C": (0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E), "D": (0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C),
    "E": (0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F), "F": (0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10),
    "G": (0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F), "H": (0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11),
    "I": (0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E), "J": (0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C),
    "K": (0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11), "L": (0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F),
    "M": (0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11), "N": (0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11),
    "O": (0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E), "P": (0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10),
    "Q": (0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D), "R": (0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11),
    "S": (0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E), "T": (0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04),
    "U": (0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E), "V": (0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04),
    "W": (0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A), "X": (0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11),
    "Y": (0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04), "Z": (0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F),
    ".": (0, 0, 0, 0, 0, 0x0C, 0x0C), "-": (0, 0, 0, 0x1F, 0, 0, 0), "_": (0, 0, 0, 0, 0, 0, 0x1F),
    ":": (0, 0x0C, 0x0C, 0, 0x0C, 0x0C, 0), "+": (0, 0x04, 0x04, 0x1F, 0x04, 0x04, 0),
    "(": (0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02), ")": (0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08),
    "/": (0x01, 0x01, 0x02, 0x04, 0x08, 0x10, 0x10), "#": (0x0A, 0x0A, 0x1F, 0x0A, 0x1F, 0x0A, 0x0A),
    "=": (0, 0, 0x1F, 0, 0x1F, 0, 0), "%": (0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03),
    ",": (0, 0, 0, 0, 0x0C, 0x04, 0x08), "<": (0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02),
    ">": (0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08), " ": (0, 0, 0, 0, 0, 0, 0),
    "?": (0x0E, 0x11, 0x01, 0x02, 0x04, 0, 0x04),
}
GLYPH_W, GLYPH_H = 5, 7


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def encode_png(width: int, height: int, rgb: bytes | bytearray) -> bytes:
    """PNG bytes of an 8-bit RGB raster (``rgb``: ``width·height·3`` bytes, rows top first)."""
    if len(rgb) != width * height * 3:
        raise ValueError(f"raster has {len(rgb)} bytes, expected {width * height * 3}")
    stride = width * 3
    raw = b"".join(b"\x00" + bytes(rgb[y * stride : (y + 1) * stride]) for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(raw, 9))
        + _chunk(b"IEND", b"")
    )


class Canvas:
    """An RGB raster with the few drawing primitives the chart needs (clipped to the canvas)."""

    def __init__(self, width: int, height: int, background: Color = WHITE):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = (y * self.width + x) * 3
            self.pixels[i : i + 3] = bytes(color)

    def get(self, x: int, y: int) -> Color:
        i = (y * self.width + x) * 3
        return tuple(self.pixels[i : i + 3])  # type: ignore[return-value]

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Filled rectangle with corners (x0, y0) and (x1, y1), inclusive."""
        for y in range(max(min(y0, y1), 0), min(max(y0, y1), self.height - 1) + 1):
            for x in range(max(min(x0, x1), 0), min(max(x0, x1), self.width - 1) + 1):
                self.set(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, width: int = 1) -> None:
        """Bresenham line, ``width`` pixels thick (square pen)."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err, lo = dx + dy, -(width // 2)
        while True:
            for ox in range(lo, lo + width):
                for oy in range(lo, lo + width):
                    self.set(x0 + ox, y0 + oy, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    def text(self, x: int, y: int, text: str, color: Color = BLACK, scale: int = 2) -> int:
        """Draw ``text`` with its top-left at (x, y); returns the x after the last glyph."""
        for ch in text:
            rows = _FONT.get(ch.upper(), _FONT["?"])
            for r, bits in enumerate(rows):
                for c in range(GLYPH_W):
                    if bits & (0x10 >> c):
                        self.rect(x + c * scale, y + r * scale,
                                  x + (c + 1) * scale - 1, y + (r + 1) * scale - 1, color)
            x += (GLYPH_W + 1) * scale
        return x

    def vtext(self, x: int, y: int, text: str, color: Color = BLACK, scale: int = 2) -> None:
        """Draw ``text`` rotated 90° counter-clockwise, reading upwards from (x, y)."""
        for i, ch in enumerate(text):
            rows = _FONT.get(ch.upper(), _FONT["?"])
            base = y - i * (GLYPH_W + 1) * scale
            for r, bits in enumerate(rows):
                for c in range(GLYPH_W):
                    if bits & (0x10 >> c):
                        px, py = x + r * scale, base - (c + 1) * scale + 1
                        self.rect(px, py, px + scale - 1, py + scale - 1, color)

    def png(self) -> bytes:
        return encode_png(self.width, self.height, self.pixels)


def text_width(text: str, scale: int = 2) -> int:
    return len(text) * (GLYPH_W + 1) * scale


X_LABEL_PITCH = 20
"""Pixels per x tick the chart widens to (an upright label is 14 pixels wide at scale 2)."""
MAX_WIDTH = 2400
"""The chart widens for its x labels up to this many pixels."""


def _decade_label(exp: int) -> str:
    return f"1E{exp}"


def line_chart(
    series: dict[str, list[float | None]],
    x_labels: list[str],
    *,
    title: str = "",
    y_label: str = "",
    x_label: str = "",
    width: int = 960,
    height: int = 520,
    floor: float = 1e-9,
) -> Canvas:
    """A log-y line chart: one line per ``series`` entry (``None`` = no point) over ``x_labels``.

    Values ``<= floor`` are drawn at ``floor``. The y axis spans whole decades with a grid
    line and a ``1E-n`` label per decade; x ticks are the ``x_labels``, written upwards under
    the axis. The canvas grows past ``width`` × ``height`` to fit them: wider so that every
    label has a column of its own (up to :data:`MAX_WIDTH`; past that they are thinned),
    taller by the longest label. The legend on the right lists the series in their colours.
    """
    scale = 2
    n = len(x_labels)
    legend_w = max([text_width(name, scale) for name in series] + [0]) + 50
    left, right, top = 96, legend_w + 20, 50
    width = min(max(width, left + right + n * X_LABEL_PITCH), max(width, MAX_WIDTH))
    label_h = max((text_width(lbl, scale) for lbl in x_labels), default=0)
    bottom = label_h + 60
    height += max(0, bottom - 70)
    canvas = Canvas(width, height)
    x0, x1, y0, y1 = left, width - right, top, height - bottom  # plot area (y0 top)
    values = [v for vals in series.values() for v in vals if v is not None]
    logs = [math.log10(max(v, floor)) for v in values] or [0.0]
    lo, hi = math.floor(min(logs)), math.ceil(max(logs))
    if hi == lo:
        hi = lo + 1

    def ypos(v: float) -> int:
        return round(y1 - (math.log10(max(v, floor)) - lo) / (hi - lo) * (y1 - y0))

    def xpos(i: int) -> int:
        return round(x0 + (i + 0.5) * (x1 - x0) / max(n, 1))

    for e in range(lo, hi + 1):  # decades: grid line and label
        y = ypos(10.0**e)
        canvas.line(x0, y, x1, y, GRID)
        label = _decade_label(e)
        canvas.text(x0 - 8 - text_width(label, scale), y - GLYPH_H * scale // 2, label, AXIS, scale)
        canvas.line(x0 - 5, y, x0, y, AXIS)
    canvas.line(x0, y0, x0, y1, AXIS, 2)
    canvas.line(x0, y1, x1, y1, AXIS, 2)
    step = max(1, math.ceil((GLYPH_H * scale + 4) / max((x1 - x0) / max(n, 1), 1.0)))
    for i, lbl in enumerate(x_labels):
        x = xpos(i)
        canvas.line(x, y1, x, y1 + 5, AXIS)
        if i % step == 0:  # upwards, ending just under the axis
            canvas.vtext(x - GLYPH_H * scale // 2, y1 + 8 + text_width(lbl, scale), lbl, AXIS, scale)
    for idx, (name, vals) in enumerate(series.items()):
        color = PALETTE[idx % len(PALETTE)]
        pts = [(xpos(i), ypos(v)) for i, v in enumerate(vals) if v is not None]
        for (ax, ay), (bx, by) in zip(pts, pts[1:]):
            canvas.line(ax, ay, bx, by, color, 2)
        for px, py in pts:
            canvas.rect(px - 3, py - 3, px + 3, py + 3, color)
        ly = top + idx * (GLYPH_H * scale + 10)
        lx = width - right + 16
        canvas.rect(lx, ly + 3, lx + 22, ly + 9, color)
        canvas.text(lx + 30, ly, name, BLACK, scale)
    if title:
        canvas.text(max(4, (width - text_width(title, scale)) // 2), 14, title, BLACK, scale)
    if x_label:
        canvas.text(x0 + (x1 - x0 - text_width(x_label, scale)) // 2, height - 24, x_label, AXIS, scale)
    if y_label:
        canvas.vtext(12, y0 + (y1 - y0 + text_width(y_label, scale)) // 2, y_label, AXIS, scale)
    return canvas


def write_png(path: str | Path, canvas: Canvas) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(canvas.png())
    return path
