"""A GGUF file's tensors dequantized as ggml does it, read with numpy alone (no MLX): the reference
that the imported weights are checked against.

Only what the embedded model holds: F32, F16, Q4_1 (blocks of 32: a float16 scale ``d``, a
float16 minimum ``m``, 16 bytes whose low nibbles are values 0-15 and high nibbles 16-31,
``x = q * d + m``) and Q8_0 (a float16 scale, 32 int8, ``x = q * d``). The values are
computed in float64, exactly, and rounded once to float32, as ggml's float32 arithmetic
rounds them (the products of a 16-bit scale and a small integer are exact in float32).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

F32, F16, Q4_1, Q8_0 = 0, 1, 3, 8
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def take(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += struct.calcsize("<" + fmt)
        return value[0]

    def string(self) -> str:
        length = self.take("Q")
        text = self.data[self.at : self.at + length].decode("utf-8", "replace")
        self.at += length
        return text

    def value(self, kind: int):
        if kind == 8:
            return self.string()
        if kind == 9:
            inner, count = self.take("I"), self.take("Q")
            return [self.value(inner) for _ in range(count)]
        return self.take(_SCALARS[kind])


def tensors(path: str | Path) -> dict[str, tuple[int, tuple[int, ...], np.ndarray]]:
    """``name -> (ggml type, numpy shape, raw bytes)`` for each tensor of the file (memory-mapped)."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    header = bytes(raw[: 16 * 1024 * 1024])  # the metadata (tokenizer included) fits in the first 16 MB here
    reader = _Reader(header)
    if reader.data[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    reader.at = 4
    reader.take("I")  # the format version
    n_tensors, n_values = reader.take("Q"), reader.take("Q")
    alignment = 32
    for _ in range(n_values):
        key, kind = reader.string(), reader.take("I")
        value = reader.value(kind)
        if key == "general.alignment":
            alignment = value
    infos = []
    for _ in range(n_tensors):
        name, n_dims = reader.string(), reader.take("I")
        dims = [reader.take("Q") for _ in range(n_dims)]
        kind, offset = reader.take("I"), reader.take("Q")
        infos.append((name, kind, tuple(reversed(dims)), offset))
    start = (reader.at + alignment - 1) // alignment * alignment
    found = {}
    for name, kind, shape, offset in infos:
        count = int(np.prod(shape))
        size = {F32: 4 * count, F16: 2 * count, Q4_1: count // 32 * 20, Q8_0: count // 32 * 34}[kind]
        found[name] = (kind, shape, raw[start + offset : start + offset + size])
    return found


def dequantized(kind: int, shape: tuple[int, ...], data: np.ndarray) -> np.ndarray:
    """A tensor's values as ggml dequantizes them, float32."""
    if kind == F32:
        return data.view(np.float32).reshape(shape).copy()
    if kind == F16:
        return data.view(np.float16).astype(np.float32).reshape(shape)
    if kind == Q4_1:
        blocks = np.asarray(data).reshape(-1, 20)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
        qs = blocks[:, 4:20]
        q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float64)  # values 0-15, then 16-31
        return (q * d + m).astype(np.float32).reshape(shape)
    if kind == Q8_0:
        blocks = np.asarray(data).reshape(-1, 34)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64)
        q = blocks[:, 2:34].copy().view(np.int8).astype(np.float64)
        return (q * d).astype(np.float32).reshape(shape)
    raise ValueError(f"ggml type {kind} is not read here")
