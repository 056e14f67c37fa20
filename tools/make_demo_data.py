"""Generate a small, learnable image-folder dataset of coloured shapes for the demo.

Writes ``OUT_DIR/<class>/<class>_<index>.jpg`` (JPEG, ``--size`` px square) for 10 classes
that differ by *shape only*: colour, size, position, rotation jitter and background noise are
random, so a small CNN must learn shapes (it reaches >= 90 % accuracy in a couple of CPU
minutes). Output is a pure function of ``--seed`` and ``--num-images``: every image draws from
its own RNG seeded by (seed, index), so the same arguments give byte-identical files.

Example::

    python tools/make_demo_data.py data/demo-images --num-images 3000 --seed 0 --size 64
    hpctrain convert data/demo-images data/demo-shards --val-fraction 0.1 --shuffle --seed 0
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

# Sorted, so that torchvision-style "classes sorted -> labels" gives labels in this order.
CLASS_NAMES = (
    "circle",
    "cross",
    "diamond",
    "hbar",
    "ring",
    "square",
    "star",
    "triangle",
    "vbar",
    "xmark",
)

Point = tuple[float, float]
DrawFn = Callable[[ImageDraw.ImageDraw, float, float, float, tuple[int, int, int], float], None]


def _rotate(points: list[Point], cx: float, cy: float, angle: float) -> list[Point]:
    cos, sin = math.cos(angle), math.sin(angle)
    return [(cx + x * cos - y * sin, cy + x * sin + y * cos) for x, y in points]


def _circle(draw: ImageDraw.ImageDraw, cx: float, cy: float, r: float, color, angle: float) -> None:
    draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=color)


def _ring(draw: ImageDraw.ImageDraw, cx: float, cy: float, r: float, color, angle: float) -> None:
    draw.ellipse((cx - r, cy - r, cx + r, cy + r), outline=color, width=max(2, round(r * 0.3)))


def _square(draw: ImageDraw.ImageDraw, cx: float, cy: float, r: float, color, angle: float) -> None:
    s = r * 0.85
    draw.polygon(_rotate([(-s, -s), (s, -s), (s, s), (-s, s)], cx, cy, angle), fill=color)


def _diamond(
    draw: ImageDraw.ImageDraw, cx: float, cy: float, r: float, color, angle: float
) -> None:
    # A square turned by 45 degrees, narrower than tall so it never looks like a square.
    pts = [(0.0, -r), (r * 0.65, 0.0), (0.0, r), (-r * 0.65, 0.0)]
    draw.polygon(_rotate(pts, cx, cy, angle), fill=color)


def _triangle(
    draw: ImageDraw.ImageDraw, cx: float, cy: float, r: float, color, angle: float
) -> None:
    pts = [(r * math.cos(a), r * math.sin(a)) for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)]
    draw.polygon(_rotate(pts, cx, cy, angle), fill=color)


def _star(draw: ImageDraw.ImageDraw, cx: float, cy: float, r: float, color, angle: float) -> None:
    pts = []
    for k in range(10):
        radius = r if k % 2 == 0 else r * 0.4
        a = -math.pi / 2 + k * math.pi / 5
        pts.append((radius * math.cos(a), radius * math.sin(a)))
    draw.polygon(_rotate(pts, cx, cy, angle), fill=color)


def _bar(draw, cx: float, cy: float, r: float, color, angle: float, *, vertical: bool) -> None:
    w, h = r, r * 0.28
    pts = [(-w, -h), (w, -h), (w, h), (-w, h)]
    if vertical:
        pts = [(y, x) for x, y in pts]
    draw.polygon(_rotate(pts, cx, cy, angle), fill=color)


def _hbar(draw: ImageDraw.ImageDraw, cx: float, cy: float, r: float, color, angle: float) -> None:
    _bar(draw, cx, cy, r, color, angle, vertical=False)


def _vbar(draw: ImageDraw.ImageDraw, cx: float, cy: float, r: float, color, angle: float) -> None:
    _bar(draw, cx, cy, r, color, angle, vertical=True)


def _plus(draw, cx: float, cy: float, r: float, color, angle: float) -> None:
    w = r * 0.25
    for pts in ([(-r, -w), (r, -w), (r, w), (-r, w)], [(-w, -r), (w, -r), (w, r), (-w, r)]):
        draw.polygon(_rotate(pts, cx, cy, angle), fill=color)


def _cross(draw: ImageDraw.ImageDraw, cx: float, cy: float, r: float, color, angle: float) -> None:
    _plus(draw, cx, cy, r, color, angle)


def _xmark(draw: ImageDraw.ImageDraw, cx: float, cy: float, r: float, color, angle: float) -> None:
    _plus(draw, cx, cy, r, color, angle + math.pi / 4)


SHAPES: dict[str, DrawFn] = {
    "circle": _circle,
    "cross": _cross,
    "diamond": _diamond,
    "hbar": _hbar,
    "ring": _ring,
    "square": _square,
    "star": _star,
    "triangle": _triangle,
    "vbar": _vbar,
    "xmark": _xmark,
}


def _contrasting_colors(
    rng: np.random.Generator,
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """A background and a shape colour far enough apart that the shape is always visible."""
    while True:
        bg = rng.integers(0, 256, size=3)
        fg = rng.integers(0, 256, size=3)
        if np.abs(bg.astype(int) - fg.astype(int)).sum() >= 240:
            return tuple(int(v) for v in bg), tuple(int(v) for v in fg)  # type: ignore[return-value]


def make_image(index: int, seed: int, size: int) -> tuple[str, Image.Image]:
    """The class name and image for sample `index` (a pure function of its arguments)."""
    rng = np.random.default_rng([seed, index])
    name = CLASS_NAMES[index % len(CLASS_NAMES)]
    bg, fg = _contrasting_colors(rng)
    # Draw at 4x and downsample: smooth edges, so JPEG artefacts do not dominate small shapes.
    scale = 4
    big = size * scale
    image = Image.new("RGB", (big, big), bg)
    draw = ImageDraw.Draw(image)
    r = rng.uniform(0.25, 0.42) * big
    margin = r * 1.02
    cx = rng.uniform(margin, big - margin)
    cy = rng.uniform(margin, big - margin)
    angle = rng.uniform(
        -0.25, 0.25
    )  # small jitter: bars stay horizontal/vertical, + stays apart from x
    SHAPES[name](draw, cx, cy, r, fg, angle)
    image = image.resize((size, size), Image.Resampling.BILINEAR)
    pixels = np.asarray(image).astype(np.int16)
    noise = rng.normal(0.0, rng.uniform(4.0, 16.0), size=pixels.shape)
    pixels = np.clip(pixels + noise, 0, 255).astype(np.uint8)
    return name, Image.fromarray(pixels)


def generate(out_dir: Path, *, num_images: int, seed: int, size: int, quality: int = 90) -> None:
    """Write `num_images` JPEGs (classes balanced) under `out_dir/<class>/`."""
    for name in CLASS_NAMES:
        (out_dir / name).mkdir(parents=True, exist_ok=True)
    for index in range(num_images):
        name, image = make_image(index, seed, size)
        image.save(out_dir / name / f"{name}_{index:06d}.jpg", format="JPEG", quality=quality)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="folder to write <class>/<file>.jpg into")
    parser.add_argument("--num-images", type=int, default=3000, help="total images (default 3000)")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    parser.add_argument("--size", type=int, default=64, help="image side in px (default 64)")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality (default 90)")
    args = parser.parse_args(argv)
    if args.num_images < 1 or args.size < 8:
        parser.error("--num-images must be >= 1 and --size >= 8")
    generate(
        args.out_dir,
        num_images=args.num_images,
        seed=args.seed,
        size=args.size,
        quality=args.quality,
    )
    print(
        f"wrote {args.num_images} images in {len(CLASS_NAMES)} classes to {args.out_dir}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
