"""Image inputs: decode from a path, base64 or data URL (never fetched from the network), hash the pixels."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,(?P<data>.*)$", re.S)


def _pil():
    try:
        from PIL import Image  # optional dependency (the multimodal extra)
    except ImportError as e:  # pragma: no cover - pillow is a dependency of the multimodal extra
        raise ImportError("image inputs need pillow: pip install 'sglang-backend[multimodal]'") from e
    return Image


def _decode_bytes(data: bytes, what: str, unreadable: ValueError | None = None):
    """``unreadable``: the error for bytes that are not an image, in place of the decoder's own."""
    Image = _pil()
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except Image.DecompressionBombError as e:
        raise ValueError(f"{what}: image is too large ({e})") from None
    except Exception as e:  # noqa: BLE001 - PIL raises many types for bad files; all mean "unreadable"
        if unreadable is not None:
            raise unreadable from None
        detail = re.sub(r" ?<_io\.BytesIO object at 0x[0-9a-f]+>", "", str(e))  # a memory address helps no one
        raise ValueError(f"{what}: cannot decode the image ({type(e).__name__}: {detail})") from None
    return img.convert("RGB")


def _refused(what: str) -> ValueError:
    """The one error for every string that is neither a base64 image nor a data URL while local paths are
    disabled: the same bytes whatever the string names (an existing file, a missing one, a directory, an
    unreadable one), so a client cannot probe the server's file system. Nothing is looked up to produce it."""
    return ValueError(f"{what}: expected a base64-encoded image or a data URL (data:image/<format>;base64,...); "
                      "local file paths are disabled on this server (start it with --allow-local-media)")


def _read_path(path: str, what: str):
    """Only with ``allow_local_media``: the errors may then name the problem."""
    if not os.path.isfile(path):
        raise ValueError(f"{what}: image file not found: {path!r}")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{what}: cannot read image file {path!r} ({e.strerror or type(e).__name__})") from None
    return _decode_bytes(data, what)


def load_image(item, allow_local_media: bool = False, what: str = "image"):
    """A PIL RGB image from: a PIL image, encoded bytes, a ``data:image/...;base64,`` URL, a bare base64
    string, or a file path (``file://`` too) when ``allow_local_media``. Raises ValueError naming the problem."""
    Image = _pil()
    if isinstance(item, Image.Image):
        return item.convert("RGB")
    if type(item).__module__ == "numpy":  # an H x W x 3 uint8 array
        return Image.fromarray(item).convert("RGB")
    if isinstance(item, (bytes, bytearray)):
        return _decode_bytes(bytes(item), what)
    if isinstance(item, dict):  # OpenAI-style {"url": ...}
        item = item.get("url")
    if not isinstance(item, str) or not item:
        raise ValueError(f"{what}: expected a path, base64 string or data URL, got {type(item).__name__}")
    if item.startswith("data:"):
        m = _DATA_URL.match(item)
        if m is None or not m.group("b64"):
            raise ValueError(f"{what}: unsupported data URL (expected data:image/<format>;base64,<data>)")
        mime = (m.group("mime") or "").lower()
        if not mime.startswith("image/"):
            raise ValueError(f"{what}: unsupported format {mime or 'unknown'!r}; expected an image/* data URL")
        try:
            data = base64.b64decode(m.group("data"), validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{what}: the data URL's base64 payload is invalid") from None
        return _decode_bytes(data, what)
    if item.startswith(("http://", "https://")):
        raise ValueError(f"{what}: remote URLs are not fetched; send the image as base64 or a data URL")
    if not allow_local_media:
        # Bare base64 or nothing. The file system is never consulted: any string that is not a decodable
        # base64 image (file:// URLs and paths of every kind included) gets the one message of _refused.
        if item.startswith("file://"):
            raise _refused(what)
        try:
            data = base64.b64decode(item, validate=True)
        except (binascii.Error, ValueError):
            raise _refused(what) from None
        return _decode_bytes(data, what, unreadable=_refused(what))
    if item.startswith("file://"):
        return _read_path(item[len("file://"):], what)
    if len(item) < 4096 and os.path.exists(item):
        return _read_path(item, what)
    try:
        data = base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError):
        if os.sep in item or os.path.splitext(item)[1]:  # meant as a path
            return _read_path(item, what)
        raise ValueError(f"{what}: not a file path, a data URL or base64: {item[:80]!r}") from None
    return _decode_bytes(data, what)


def image_hash(img) -> str:
    """Hex SHA-256 of the decoded RGB pixels and size: equal pixels share KV whatever the file encoding;
    a single changed pixel gives another hash."""
    h = hashlib.sha256()
    h.update(f"{img.mode}:{img.size[0]}x{img.size[1]}:".encode())
    h.update(img.tobytes())
    return h.hexdigest()


def encode_image_data_url(img, fmt: str = "PNG") -> str:
    """A data URL of a PIL image (how the DSL sends video frames and in-memory images to a server)."""
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()
