"""Pictures in a request, from whichever dialect: a data URL's bytes (Ollama's and Anthropic's base64 fields arrive as
data URLs), decoded into an RGB image for the model's processor within this server's limits; APIError 400 naming the
field otherwise.

A remote (http / https) address is refused: fetching it would let any client make the server reach any address its
network reaches. Decoding happens off the event loop (the render), its size read from the image's header first, so a
small file that claims a huge canvas (a decompression bomb) is refused before its pixels are allocated.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass

from kvforge.app.http.errors import APIError
from kvforge.core.images import ImageInput

MAX_IMAGES = 16  # per request (every turn's pictures count: a chat re-sends its history)
MAX_IMAGE_BYTES = 20 << 20  # one picture's encoded bytes (OpenAI's own limit); the body limit applies first
MAX_IMAGE_PIXELS = 40_000_000  # one picture's width x height (a 48 MP phone photo is refused; 8K video frames pass)


@dataclass
class Picture:
    """A decoded picture and the digest of its bytes (the prefix cache's key for its positions: core/images.py)."""

    image: object  # PIL.Image.Image, RGB
    digest: bytes


def picture_bytes(url: str, field: str) -> bytes:
    """The bytes of a data URL (`data:[<type>][;base64],<data>`)."""
    if url.startswith(("http://", "https://")):
        raise APIError(400, f"{field}: remote image URLs are not fetched by this server; send the picture as a "
                       "data URL (data:image/png;base64,...)", field)
    if not url.startswith("data:") or "," not in url:
        raise APIError(400, f"{field}: an image must be a data URL (data:image/png;base64,...)", field)
    header, data = url[5:].split(",", 1)
    if not header.endswith(";base64"):
        raise APIError(400, f"{field}: a data URL's picture must be base64 (data:image/png;base64,...)", field)
    if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise APIError(400, f"{field}: a picture may take {MAX_IMAGE_BYTES >> 20} MiB at most", field)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{field}: the data URL's base64 does not decode", field) from None


def open_picture(data: bytes, field: str) -> Picture:
    """`data` (any format Pillow reads) as an RGB image, its size checked from the header before decoding."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as opened:
            width, height = opened.size
            if width * height > MAX_IMAGE_PIXELS:
                raise APIError(400, f"{field}: a picture of {width} x {height} pixels is over this server's "
                               f"{MAX_IMAGE_PIXELS // 1_000_000} million", field)
            image = opened.convert("RGB")  # decodes (its first frame, for an animation)
    except APIError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise APIError(400, f"{field}: not a picture this server can read ({exc})", field) from None
    return Picture(image, ImageInput.digest_of(data))


def picture_media_type(data: bytes) -> str:
    """The MIME type of a picture's bytes, by Pillow's reading of its header (application/octet-stream if none)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as opened:
            return Image.MIME.get(opened.format or "", "application/octet-stream")
    except Exception:  # bytes kept before Pillow changed its mind: served as bytes
        return "application/octet-stream"


def read_pictures(urls: list[str], field: str) -> list[Picture]:
    """Every picture of a request, in order."""
    if len(urls) > MAX_IMAGES:
        raise APIError(400, f"{field}: {len(urls)} pictures; a request may carry {MAX_IMAGES}", field)
    return [open_picture(picture_bytes(url, field), field) for url in urls]
