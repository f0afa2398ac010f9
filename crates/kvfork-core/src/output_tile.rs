//! Padding a decode's output rows to whole tiles of the CPU's output matmul.
//!
//! llama.cpp's x86 kernel for Q8_0, Q4_0, Q5_0 and IQ4_NL weights (llamafile's tinyBLAS,
//! with AVX-512) computes 4 output rows per pass over the weight matrix and makes one more
//! pass for a remainder of 1–3 rows. With a large vocabulary the output layer dominates a
//! batched step, so a step of 15 rows costs more than one of 16: Gemma 3 270M, 2 threads,
//! 13, 14, 15 rows 73.5, 79.7, 82.3 ms and 16 rows 70.9 ms (BENCHMARKS.md §1–2). Adding the
//! missing rows (their logits thrown away) is then cheaper than leaving them out.

/// Rows to add to a decode of `outputs` output rows so that they fill whole tiles of `tile`
/// rows; 0 when no tiling applies (`tile` ≤ 1), when `outputs` fits one tile (one pass
/// already), when they are whole already, or when the padding would not fit the `room`
/// rows left in the batch.
pub fn padding(outputs: usize, tile: usize, room: usize) -> usize {
    if tile <= 1 || outputs <= tile {
        return 0;
    }
    let pad = (tile - outputs % tile) % tile;
    if pad <= room {
        pad
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn fills_the_last_tile() {
        assert_eq!(padding(15, 4, 100), 1);
        assert_eq!(padding(13, 4, 100), 3);
        assert_eq!(padding(16, 4, 100), 0);
        assert_eq!(padding(5, 4, 100), 3);
    }

    #[test]
    fn leaves_one_tile_untouched() {
        for n in 0..=4 {
            assert_eq!(padding(n, 4, 100), 0, "{n} rows take one pass already");
        }
    }

    #[test]
    fn no_tiling_or_no_room_means_no_padding() {
        assert_eq!(padding(15, 1, 100), 0);
        assert_eq!(padding(15, 0, 100), 0);
        assert_eq!(padding(13, 4, 2), 0);
        assert_eq!(padding(13, 4, 3), 3);
    }

    proptest! {
        #[test]
        fn padded_rows_are_whole_tiles_within_room(
            outputs in 0usize..2048, tile in 0usize..17, room in 0usize..64,
        ) {
            let pad = padding(outputs, tile, room);
            prop_assert!(pad <= room);
            if pad > 0 {
                prop_assert!(tile > 1 && outputs > tile && pad < tile);
                prop_assert_eq!((outputs + pad) % tile, 0);
            } else if tile > 1 && outputs > tile && room >= tile {
                prop_assert_eq!(outputs % tile, 0, "room enough: only whole tiles go unpadded");
            }
        }
    }
}
