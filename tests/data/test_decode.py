"""Default field decoders (`hpctrain.data.decode`): one test per decoder, targets, bombs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from hpctrain.data import decode as decode_module
from hpctrain.data.decode import (
    DEFAULT_MAX_PIXELS,
    SampleError,
    decode_field,
    decode_image,
    decode_sample,
    read_header,
)
from hpctrain.data.fieldnames import IMAGE_EXTENSIONS, is_target_field
from hpctrain.errors import DataError
from tests.support.sample_kit import (
    PALETTE,
    bomb_png,
    encoded,
    jpeg,
    multi_field_members,
    npy,
    palette_mask,
    png,
    rgb,
    torch_bytes,
)


@pytest.fixture(scope="module")
def bomb() -> bytes:
    return bomb_png()


def test_the_default_pixel_limit_is_pils():
    assert DEFAULT_MAX_PIXELS == 89_478_485
    assert {"jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "ppm"} <= IMAGE_EXTENSIONS


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("mask.png", True),
        ("seg.png", True),
        ("label.png", True),
        ("depth.png", True),
        ("instance_MASK.tif", True),
        ("segmentation.png", True),
        ("jpg", False),
        ("img.jpg", False),
        ("left.png", False),
    ],
)
def test_target_fields_are_named_by_their_markers(name, target):
    assert is_target_field(name) is target


def test_png_colour_image_is_exact_rgb_chw_uint8():
    pixels = rgb(3, 7, 9)
    out = decode_field("png", png(pixels))
    assert out.dtype == torch.uint8 and out.shape == (3, 7, 9)
    assert torch.equal(out, torch.from_numpy(pixels).permute(2, 0, 1))


@pytest.mark.parametrize("name", ["jpg", "img.jpeg", "left.JPG"])
def test_jpeg_decodes_to_rgb_close_to_the_source(name):
    pixels = np.full((8, 8, 3), (200, 40, 90), dtype=np.uint8)
    out = decode_field(name, jpeg(pixels, quality=95))
    assert out.dtype == torch.uint8 and out.shape == (3, 8, 8)
    assert (out.int() - torch.tensor([200, 40, 90]).view(3, 1, 1)).abs().max() <= 4


@pytest.mark.parametrize(
    ("ext", "fmt"),
    [
        ("bmp", "BMP"),
        ("tif", "TIFF"),
        ("tiff", "TIFF"),
        ("ppm", "PPM"),
        ("webp", "WEBP"),
        ("gif", "GIF"),
    ],
)
def test_other_image_formats_decode_to_rgb(ext, fmt):
    pixels = np.zeros((4, 6, 3), dtype=np.uint8)
    out = decode_field(f"photo.{ext}", encoded(fmt, pixels))
    assert out.dtype == torch.uint8 and out.shape == (3, 4, 6)


def test_grey_image_outside_target_fields_becomes_rgb():
    grey = np.arange(20, dtype=np.uint8).reshape(4, 5)
    out = decode_field("jpg.png", png(grey))
    assert out.shape == (3, 4, 5) and torch.equal(out[0], torch.from_numpy(grey))
    assert torch.equal(out[0], out[2])


def test_palette_mask_keeps_its_indices():
    mask = palette_mask(1, 9, 11, classes=20)
    out = decode_field("mask.png", png(mask, mode="P", palette=PALETTE))
    assert out.dtype == torch.uint8 and out.shape == (9, 11)
    assert torch.equal(out, torch.from_numpy(mask))


def test_palette_image_outside_target_fields_becomes_its_colours():
    mask = palette_mask(1, 3, 4)
    out = decode_field("png", png(mask, mode="P", palette=PALETTE))
    palette = torch.tensor(PALETTE, dtype=torch.uint8).view(256, 3)
    assert out.shape == (3, 3, 4)
    assert torch.equal(out.permute(1, 2, 0), palette[torch.from_numpy(mask).long()])


def test_grey_mask_keeps_raw_values_and_16_bit_depth_stays_uint16():
    grey = np.arange(12, dtype=np.uint8).reshape(3, 4)
    out = decode_field("seg.png", png(grey))
    assert out.dtype == torch.uint8 and torch.equal(out, torch.from_numpy(grey))
    deep = (np.arange(12, dtype=np.uint16) * 5000).reshape(3, 4)
    out16 = decode_field("depth.png", png(deep))
    assert out16.dtype == torch.uint16 and out16.shape == (3, 4)
    assert np.array_equal(out16.numpy(), deep)


def test_16_bit_image_outside_target_fields_is_scaled_to_8_bits():
    deep = (np.arange(12, dtype=np.uint16) * 5000).reshape(3, 4)
    out = decode_field("png", png(deep))
    assert out.dtype == torch.uint8 and out.shape == (3, 3, 4)
    assert np.array_equal(out[1].numpy(), (deep >> 8).astype(np.uint8))


def test_grey_jpeg_mask_and_one_bit_mask_keep_values():
    grey = np.full((8, 8), 3, dtype=np.uint8)
    out = decode_field("label.jpg", jpeg(grey, quality=100))
    assert out.shape == (8, 8) and out.dtype == torch.uint8
    bits = np.array([[True, False], [False, True]])
    one_bit = decode_field("mask.png", png(bits))
    assert one_bit.tolist() == [[1, 0], [0, 1]]


def test_colour_image_in_a_target_field_is_rgb():
    out = decode_field("mask.png", png(rgb(2, 3, 3)))
    assert out.shape == (3, 3, 3)


@pytest.mark.parametrize(
    ("name", "data", "value"),
    [
        ("cls", b"7", 7),
        ("cls", b" 12\n", 12),
        ("cls2", b"3", 3),
        ("index", b"42", 42),
        ("id", b"-1", -1),
        ("json", b'{"a": [1, 2]}', {"a": [1, 2]}),
        ("txt", "é".encode(), "é"),
        ("caption.text", b"hi", "hi"),
        ("tokens.bin", b"\x01\x02", b"\x01\x02"),  # tokens.u16 decodes: test_sequences
        ("weird", b"\x00", b"\x00"),
    ],
)
def test_scalar_text_json_and_raw_fields(name, data, value):
    out = decode_field(name, memoryview(data))
    assert out == value and type(out) is type(value)


@pytest.mark.parametrize(
    "array",
    [
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.arange(4, dtype=">i4"),  # big-endian: torch takes native order only
        np.array([True, False]),
        np.arange(12, dtype=np.uint16).reshape(3, 2, 2)[:, ::-1],  # not contiguous
    ],
)
def test_npy_round_trip(array):
    out = decode_field("depth.npy", npy(array))
    assert isinstance(out, torch.Tensor) and np.array_equal(out.numpy(), array)
    assert out.numpy().dtype == array.dtype.newbyteorder("=")


def test_npy_with_objects_is_refused_not_unpickled():
    import io

    out = io.BytesIO()
    np.save(out, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(SampleError, match="field 'x.npy'.*cannot be decoded.*pickle"):
        decode_field("x.npy", out.getvalue())


def test_pt_fields_load_weights_only():
    value = {"w": torch.arange(3), "n": 2}
    out = decode_field("feat.pt", torch_bytes(value))
    assert torch.equal(out["w"], value["w"]) and out["n"] == 2

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    import pickle

    with pytest.raises(SampleError, match="field 'x.pth'"):
        decode_field("x.pth", pickle.dumps(Evil(), protocol=2))


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("cls", b"cat"),
        ("cls", b""),
        ("json", b"{"),
        ("txt", b"\xff\xfe\xfa"),
        ("jpg", b"not an image"),
        ("png", b"\x89PNG\r\n\x1a\n" + b"\0" * 30),
        ("npy", b"nope"),
    ],
)
def test_bad_bytes_are_a_sample_error_naming_the_field(name, data):
    with pytest.raises(SampleError, match=f"field '{name}'") as info:
        decode_field(name, data)
    assert isinstance(info.value, DataError)


def test_decode_sample_names_every_field_and_the_key():
    members = multi_field_members(4)
    sample = decode_sample("k4", {k: memoryview(v) for k, v in members.items()})
    assert set(sample) == {"key", *members}
    assert sample["key"] == "k4" and sample["cls"] == 4
    assert sample["img.jpg"].shape == (3, 6, 5) and sample["mask.png"].shape == (6, 5)
    assert torch.equal(sample["mask.png"], torch.from_numpy(palette_mask(4)))
    assert sample["depth.npy"].dtype == torch.float32 and sample["json"]["seed"] == 4
    assert sample["txt"] == "caption 4 – ünïcode"
    members["cls"] = b"x"
    with pytest.raises(SampleError, match="sample 'k4': field 'cls'"):
        decode_sample("k4", members)


def test_header_sizes_match_pil():
    for data in (png(rgb(0, 33, 17)), jpeg(rgb(0, 33, 17)), png(palette_mask(0, 5, 2), mode="P")):
        header = read_header(data)
        assert header is not None
        with Image.open(__import__("io").BytesIO(data)) as image:
            assert (header.width, header.height) == image.size
    assert read_header(encoded("BMP", rgb(0))) is None  # PIL reads other headers


def test_decompression_bomb_is_refused_before_any_pixel_is_decoded(bomb, monkeypatch):
    assert len(bomb) < 1_000_000

    def no_decoding(*args, **kwargs):
        raise AssertionError("the bomb's pixels were decoded")

    monkeypatch.setattr(decode_module, "tv_decode", no_decoding)
    monkeypatch.setattr(Image.Image, "load", no_decoding)
    for name in ("png", "mask.png", "img.png"):
        with pytest.raises(SampleError, match=r"16000x16000 = 256,000,000 pixels.*max_image_pix"):
            decode_field(name, bomb)
    with pytest.raises(SampleError, match="sample 'b'"):
        decode_sample("b", {"png": bomb, "cls": b"1"})
    with pytest.raises(SampleError):
        decode_image(bomb)


def test_the_pixel_limit_is_configurable_for_every_format():
    data = png(rgb(0, 10, 10))
    assert decode_field("png", data, max_pixels=100).shape == (3, 10, 10)
    with pytest.raises(SampleError, match="10x10 = 100 pixels.*= 99"):
        decode_field("png", data, max_pixels=99)
    for fmt in ("BMP", "GIF", "TIFF"):
        with pytest.raises(SampleError, match="10x10"):
            decode_field(f"x.{fmt.lower()}", encoded(fmt, rgb(0, 10, 10)), max_pixels=99)
    with pytest.raises(SampleError, match="10x10"):
        decode_field("jpg", jpeg(rgb(0, 10, 10)), max_pixels=99)
    assert decode_field("png", data, max_pixels=0).shape == (3, 10, 10)  # 0: no limit


def test_pils_global_limit_is_left_as_it_was():
    before = Image.MAX_IMAGE_PIXELS
    decode_field("x.bmp", encoded("BMP", rgb(0)), max_pixels=10**12)
    assert before == Image.MAX_IMAGE_PIXELS


def test_sample_error_crosses_processes():
    import pickle

    error = pickle.loads(pickle.dumps(SampleError("sample 'k': field 'png': bad")))
    assert isinstance(error, SampleError) and str(error) == "sample 'k': field 'png': bad"


def test_json_field_is_any_json_value():
    assert decode_field("meta.json", json.dumps([1, "a"]).encode()) == [1, "a"]


@pytest.mark.parametrize("name", ["key", "valid"])
def test_a_member_named_like_a_loader_field_is_refused(name):
    with pytest.raises(SampleError, match=rf"s1\.{name}.*loader's own"):
        decode_sample("s1", {"cls": b"1", name: b"x"})
