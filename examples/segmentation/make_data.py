"""Generate image/mask pairs of coloured shapes, and CSV manifests that `hpctrain convert` reads.

Every image shows a few shapes on a noisy background; its mask holds each pixel's class id:
0 background, 1 disc, 2 square, 3 triangle, and 255 (unlabelled, left out of the loss and
the metrics) on a thin band along every shape's outline, as in Pascal VOC. Masks are palette
PNGs (`--mask-mode P`, their indices are the class ids) or greyscale PNGs (`L`).

    python examples/segmentation/make_data.py data/seg --train 400 --val 100
    hpctrain convert data/seg/train.csv data/seg/shards/train
    hpctrain convert data/seg/val.csv data/seg/shards/val
    hpctrain train examples/segmentation/config.yaml

The manifests have one row per sample and two columns, `img.jpg` and `mask.png`, holding
paths relative to the manifest: conversion copies each file into a member of that name
(`KEY.img.jpg`, `KEY.mask.png`). The same seed gives the same files.
"""

from __future__ import annotations

import argparse
import csv
import random
from pathlib import Path

from PIL import Image, ImageChops, ImageDraw, ImageFilter

CLASS_NAMES = ("background", "disc", "square", "triangle")
IGNORE_INDEX = 255
# A base colour per class, jittered per shape: colour helps, shape has to do the rest.
BASE_COLOURS = {1: (220, 60, 60), 2: (60, 200, 80), 3: (70, 90, 230)}


def palette() -> list[int]:
    """A palette for viewing the masks: class ids as colours, 255 white."""
    colours = [(0, 0, 0), *BASE_COLOURS.values()]
    flat = [channel for colour in colours for channel in colour]
    flat += [0] * (3 * 256 - len(flat))
    flat[3 * IGNORE_INDEX : 3 * IGNORE_INDEX + 3] = [255, 255, 255]
    return flat


def jitter(colour: tuple[int, int, int], rng: random.Random, amount: int = 50) -> tuple[int, ...]:
    return tuple(max(0, min(255, c + rng.randint(-amount, amount))) for c in colour)


def draw_shape(
    draw: ImageDraw.ImageDraw, cls: int, box: tuple[int, int, int, int], fill: object
) -> None:
    x0, y0, x1, y1 = box
    if cls == 1:
        draw.ellipse(box, fill=fill)
    elif cls == 2:
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)


def make_pair(rng: random.Random, size: int) -> tuple[Image.Image, Image.Image]:
    """One image and its mask (class ids, 255 where a 3x3 neighbourhood holds two classes)."""
    image = Image.new("RGB", (size, size), jitter((128, 128, 128), rng, 60))
    noise = Image.effect_noise((size, size), 40).convert("RGB")
    image = Image.blend(image, noise, 0.25)
    mask = Image.new("L", (size, size), 0)
    draw_image, draw_mask = ImageDraw.Draw(image), ImageDraw.Draw(mask)
    for _ in range(rng.randint(1, 3)):
        cls = rng.randint(1, 3)
        side = rng.randint(size // 4, size // 2)
        x0, y0 = rng.randint(0, size - side), rng.randint(0, size - side)
        box = (x0, y0, x0 + side - 1, y0 + side - 1)
        draw_shape(draw_image, cls, box, jitter(BASE_COLOURS[cls], rng))
        draw_shape(draw_mask, cls, box, cls)  # later shapes cover earlier ones, in both
    outline = ImageChops.difference(
        mask.filter(ImageFilter.MaxFilter(3)), mask.filter(ImageFilter.MinFilter(3))
    )
    mask.paste(IGNORE_INDEX, mask=outline.point(lambda v: 255 if v else 0))
    return image, mask


def write_split(
    out: Path, split: str, count: int, size: int, mask_mode: str, rng: random.Random
) -> Path:
    """`count` pairs under OUT/SPLIT/ and the manifest OUT/SPLIT.csv naming them."""
    folder = out / split
    folder.mkdir(parents=True, exist_ok=True)
    manifest = out / f"{split}.csv"
    with manifest.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["img.jpg", "mask.png"])
        for i in range(count):
            image, mask = make_pair(rng, size)
            image.save(folder / f"{i:05d}.jpg", quality=90)
            if mask_mode == "P":
                mask = mask.convert(
                    "P"
                )  # an L image's values become the palette indices as they are
                mask.putpalette(palette())
            mask.save(folder / f"{i:05d}.png")
            writer.writerow([f"{split}/{i:05d}.jpg", f"{split}/{i:05d}.png"])
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path, help="output folder")
    parser.add_argument("--train", type=int, default=400, help="training pairs (default 400)")
    parser.add_argument("--val", type=int, default=100, help="validation pairs (default 100)")
    parser.add_argument("--size", type=int, default=48, help="image side in pixels (default 48)")
    parser.add_argument(
        "--mask-mode", choices=("P", "L"), default="P", help="palette or greyscale masks"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    for split, count in (("train", args.train), ("val", args.val)):
        manifest = write_split(args.out, split, count, args.size, args.mask_mode, rng)
        print(f"{manifest}: {count} pairs")


if __name__ == "__main__":
    main()
