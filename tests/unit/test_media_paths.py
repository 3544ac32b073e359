"""Refused media paths tell a client nothing about the server's files (issue 21: image paths revealed whether a
file exists). With local media disabled (the default) every string that is not a base64 image or a data URL
gets one byte-identical error, and the file system is not consulted to produce it."""

from __future__ import annotations

import base64
import builtins
import io
import os

import pytest

from sglang_backend.runtime.multimodal.image import encode_image_data_url, load_image

Image = pytest.importorskip("PIL.Image")


def png_bytes() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (6, 4), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def places(tmp_path):
    """Path strings naming every kind of thing: an image file, a missing file, a directory, an unreadable file,
    a FIFO (reading one would block), system files, relative and traversal paths, file:// URLs."""
    image = tmp_path / "img.png"
    image.write_bytes(png_bytes())
    unreadable = tmp_path / "secret.png"
    unreadable.write_bytes(png_bytes())
    unreadable.chmod(0)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    return [str(image), str(tmp_path / "missing.png"), str(tmp_path), str(unreadable), str(fifo),
            "/etc/passwd", "/etc/shadow", "/proc/self/environ", "/proc/1/maps", "/dev/zero", "/",
            "../x", "../../../../etc/passwd", "x", "img.png", "~/.ssh/id_rsa",
            f"file://{image}", "file:///etc/passwd", "file://localhost/etc/shadow", "file:///nonexistent"]


def refusal(item) -> str:
    with pytest.raises(ValueError) as info:
        load_image(item, allow_local_media=False, what="image 0")
    return str(info.value)


def test_every_refused_path_gets_the_same_message(places):
    messages = {item: refusal(item) for item in places}
    assert len(set(messages.values())) == 1, messages
    message = messages[places[0]]
    assert "local file paths are disabled" in message and "base64" in message
    for item in places:  # the message names nothing the client sent
        assert len(item) < 6 or item not in message
    # the OpenAI form ({"url": ...}) too
    assert refusal({"url": places[0]}) == refusal({"url": "/etc/passwd"}) == message


def test_refusing_does_not_touch_the_file_system(places, monkeypatch):
    expected = refusal(places[1])

    def forbidden(*args, **kwargs):
        raise AssertionError(f"the file system was consulted: {args!r}")

    for name in ("stat", "lstat", "open", "access", "listdir", "scandir"):
        monkeypatch.setattr(os, name, forbidden)
    monkeypatch.setattr(builtins, "open", forbidden)
    for item in places:
        assert refusal(item) == expected, item


def test_base64_and_data_urls_still_work_without_local_media():
    raw = png_bytes()
    assert load_image(base64.b64encode(raw).decode()).size == (6, 4)
    img = load_image("data:image/png;base64," + base64.b64encode(raw).decode())
    assert load_image(encode_image_data_url(img)).size == (6, 4)
    assert load_image({"url": "data:image/png;base64," + base64.b64encode(raw).decode()}).size == (6, 4)


def test_with_local_media_allowed_errors_may_be_specific(places, tmp_path):
    assert load_image(places[0], allow_local_media=True).size == (6, 4)
    assert load_image(f"file://{places[0]}", allow_local_media=True).size == (6, 4)
    with pytest.raises(ValueError, match="not found"):
        load_image(str(tmp_path / "missing.png"), allow_local_media=True)
    with pytest.raises(ValueError, match="not found"):  # a FIFO is not opened (that would block)
        load_image(str(tmp_path / "pipe"), allow_local_media=True)
    with pytest.raises(ValueError, match="cannot decode"):
        load_image("/etc/passwd", allow_local_media=True)
