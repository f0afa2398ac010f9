"""Small LoRA adapters and control vectors for the default model (Gemma 3 270M), written with
the `gguf` package: known random A/B matrices on a few layers, so tests can check what an
adapter does to the logits."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

#: (input width, output width) of the default model's matrices the test adapters touch.
SHAPES = {"attn_q": (640, 1024), "ffn_up": (640, 2048)}


def write_lora(
    path: Path,
    *,
    layers: tuple[int, ...] = (0, 1, 2),
    rank: int = 4,
    seed: int = 0,
    magnitude: float = 0.08,
    arch: str = "gemma3",
    shapes: dict[str, tuple[int, int]] | None = None,
) -> Path:
    """A LoRA GGUF: for each layer and matrix W (n_in -> n_out), A (rank x n_in) and B
    (n_out x rank) of normal values times `magnitude`; alpha = rank (scale 1 adds B @ A)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(rank))
    for il in layers:
        for name, (n_in, n_out) in (shapes or SHAPES).items():
            a = (rng.standard_normal((rank, n_in)) * magnitude).astype(np.float32)
            b = (rng.standard_normal((n_out, rank)) * magnitude).astype(np.float32)
            writer.add_tensor(f"blk.{il}.{name}.weight.lora_a", a)
            writer.add_tensor(f"blk.{il}.{name}.weight.lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_control_vector(path: Path, rows: np.ndarray) -> Path:
    """llama.cpp's control-vector GGUF: `direction.{r + 1}` holds row r."""
    writer = gguf.GGUFWriter(str(path), arch="controlvector")
    writer.add_string("controlvector.model_hint", "gemma3")
    writer.add_uint32("controlvector.layer_count", rows.shape[0])
    for r, row in enumerate(rows):
        writer.add_tensor(f"direction.{r + 1}", row.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
