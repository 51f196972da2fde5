"""Model files that lie (issue 40, finding 4), for the bounded readers' tests: GGUF files written with the `gguf`
package's writer where the file is valid, and by bytes, or cut short, where the point is a malformed one."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np


def tiny_gguf(path: Path, tokens: int = 64, arch: str = "llama") -> Path:
    """A valid, tiny llama-shaped GGUF (two blocks of hidden 64, 4 heads, 2 KV heads; F32 tensors and one Q8_0) with
    a vocabulary of `tokens` strings: listed and estimated, not meant to generate."""
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_token_list([f"t{i}" for i in range(tokens)])
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.normal(0, 0.02, (64, 64)).astype(np.float32))  # not `tokens` rows:
    #                                                                                        the file stays small
    for layer in range(2):
        writer.add_tensor(f"blk.{layer}.attn_q.weight", rng.normal(0, 0.02, (64, 64)).astype(np.float32))
    q8_blocks = rng.integers(-8, 8, (64, 128 // 32 * 34), dtype=np.int8).view(np.uint8)  # random codes, tiny scales
    writer.add_tensor("blk.0.ffn_down.weight", q8_blocks, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def huge_array_gguf(path: Path, items: int = 1 << 62) -> Path:
    """The finding's 163-byte GGUF: an architecture and a uint8 array claiming `items` items (a few are there)."""
    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 2)
    arch = string("general.architecture") + struct.pack("<I", 8) + string("llama")
    array = string("tokenizer.ggml.token_type") + struct.pack("<IIQ", 9, 0, items) + bytes(range(64))
    path.write_bytes(header + arch + array)
    return path


def truncated_vocab_gguf(path: Path, tokens: int, keep: float = 0.8) -> Path:
    """A GGUF with a vocabulary of `tokens` strings, cut at `keep` of its length (inside the vocabulary): GGUFReader
    walks every string up to the cut (two numpy views each) before it fails, on every read."""
    tiny_gguf(path, tokens=tokens)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))
    return path
