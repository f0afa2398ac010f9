"""Find the byte offsets of GGUF metadata values and tensor types, to make files that parse
but hold values llama.cpp would abort on (the loader must refuse them)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}


@dataclass
class Layout:
    values: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (offset, type)
    strings: dict[str, list[tuple[int, int]]] = field(
        default_factory=dict
    )  # key -> [(offset, len)]
    tensor_types: dict[str, int] = field(default_factory=dict)  # name -> offset of its type


def read_layout(data: bytes) -> Layout:
    pos = 0

    def take(fmt: str) -> tuple[int | float, ...]:
        nonlocal pos
        out = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return out

    def string() -> tuple[int, int]:
        nonlocal pos
        (n,) = take("Q")
        start = pos
        pos += int(n)
        return start, int(n)

    assert data[:4] == b"GGUF"
    pos = 4
    _version, n_tensors, n_kv = take("IQQ")
    layout = Layout()
    for _ in range(int(n_kv)):
        k_off, k_len = string()
        key = data[k_off : k_off + k_len].decode()
        (ty,) = take("I")
        if ty == 8:
            layout.strings[key] = [string()]
        elif ty == 9:
            item_ty, n = take("IQ")
            if item_ty == 8:
                layout.strings[key] = [string() for _ in range(int(n))]
            else:
                pos += struct.calcsize("<" + SCALARS[int(item_ty)]) * int(n)
        else:
            layout.values[key] = (pos, int(ty))
            pos += struct.calcsize("<" + SCALARS[int(ty)])
    for _ in range(int(n_tensors)):
        n_off, n_len = string()
        name = data[n_off : n_off + n_len].decode()
        (n_dims,) = take("I")
        pos += 8 * int(n_dims)
        layout.tensor_types[name] = pos
        pos += 4 + 8  # type, offset
    return layout
