"""Pictures in a request, from whichever dialect: a data URL's bytes (Ollama's and Anthropic's base64 fields arrive as
data URLs), decoded into an RGB image for the model's processor within this server's limits; APIError 400 naming the
field otherwise.

A remote (http / https) address is refused unless its host is one the server's owner allowed (`--image-url-hosts`,
exact names): fetching any address would let any client make the server reach whatever its network reaches. An
allowed one is fetched with a time limit and the size limit, its redirects not followed (they could lead anywhere).
Decoding happens off the event loop (the render), its size read from the image's header first, so a
small file that claims a huge canvas (a decompression bomb) is refused before its pixels are allocated.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from kvforge.app.http.errors import APIError
from kvforge.core.images import ImageInput

MAX_IMAGES = 16  # per request (every turn's pictures count: a chat re-sends its history)
MAX_IMAGE_BYTES = 20 << 20  # one picture's encoded bytes (OpenAI's own limit); the body limit applies first
MAX_IMAGE_PIXELS = 40_000_000  # one picture's width x height (a 48 MP phone photo is refused; 8K video frames pass)
FETCH_TIMEOUT_S = 20.0  # an allowed host's picture: connecting and each read


@dataclass
class Picture:
    """A decoded picture and the digest of its bytes (the prefix cache's key for its positions: core/images.py)."""

    image: object  # PIL.Image.Image, RGB
    digest: bytes


def data_url(data: bytes) -> str:
    """A picture's bytes as the data URL the chat messages carry (its type left out: Pillow reads it)."""
    return "data:;base64," + base64.b64encode(data).decode()


def with_pictures(text: str, urls: list[str]) -> str | list[dict[str, Any]]:
    """A user message's content: its text, or, where it has pictures (their URLs), OpenAI's content parts: the
    pictures first, then the text (Ollama's place for a message's images; the sessions API keeps them so)."""
    if not urls:
        return text
    return [{"type": "image_url", "image_url": {"url": url}} for url in urls] + \
        ([{"type": "text", "text": text}] if text else [])


def picture_bytes(url: str, field: str, hosts: frozenset[str] = frozenset()) -> bytes:
    """The bytes of a data URL (`data:[<type>][;base64],<data>`), or of an http(s) URL on one of `hosts`."""
    if url.startswith(("http://", "https://")):
        host = (urllib.parse.urlsplit(url).hostname or "").lower()
        if host not in hosts:
            raise APIError(400, f"{field}: remote image URLs are not fetched by this server (host {host!r} is not "
                           "one it allows: --image-url-hosts); send the picture as a data URL "
                           "(data:image/png;base64,...)", field)
        return fetched(url, field)
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


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(req.full_url, code, f"redirected to {newurl}: not followed", headers, fp)


def fetched(url: str, field: str) -> bytes:
    """An allowed host's picture: its bytes, at most MAX_IMAGE_BYTES, without following redirects."""
    opener = urllib.request.build_opener(_NoRedirects)
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "kvforge"}),
                         timeout=FETCH_TIMEOUT_S) as response:
            data = response.read(MAX_IMAGE_BYTES + 1)
    except urllib.error.HTTPError as exc:
        raise APIError(400, f"{field}: fetching {url} failed: HTTP {exc.code} ({exc.reason})", field) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise APIError(400, f"{field}: fetching {url} failed: {exc}", field) from None
    if len(data) > MAX_IMAGE_BYTES:
        raise APIError(400, f"{field}: a picture may take {MAX_IMAGE_BYTES >> 20} MiB at most", field)
    return data


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


def read_pictures(urls: list[str], field: str, hosts: frozenset[str] = frozenset()) -> list[Picture]:
    """Every picture of a request, in order (`hosts`: those whose http(s) URLs are fetched)."""
    if len(urls) > MAX_IMAGES:
        raise APIError(400, f"{field}: {len(urls)} pictures; a request may carry {MAX_IMAGES}", field)
    return [open_picture(picture_bytes(url, field, hosts), field) for url in urls]
