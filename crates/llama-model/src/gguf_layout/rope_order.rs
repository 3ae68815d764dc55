//! The row order of the q and k projections in a llama.cpp GGUF, both directions.
//!
//! Hugging Face Llama checkpoints rotate the two halves of each head (`rotate_half`: element `i`
//! pairs with `i + head_dim / 2`); llama.cpp rotates adjacent pairs (`2i` with `2i + 1`). So
//! llama.cpp's converter permutes the rows of `q_proj` / `k_proj` per head:
//!
//! ```text
//! w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)
//! ```
//!
//! Hugging Face row `(h, j, i)` (head, half, index within the half) becomes GGUF row `(h, i, j)`.
//! Only whole rows move, so quantization blocks (which lie within a row) stay intact, and the
//! permutation can be applied to raw bytes of any ggml type.
//!
//! Every function takes the matrix's row count and the head count it was permuted with
//! ([`super::rope_permuted_heads`]); `rows` must be a multiple of `2 * heads`.

/// The GGUF row that holds Hugging Face row `hf_row` (what an importer reads).
pub fn gguf_row(hf_row: usize, rows: usize, heads: usize) -> usize {
    let head_rows = rows / heads;
    let half = head_rows / 2;
    let (h, within) = (hf_row / head_rows, hf_row % head_rows);
    let (j, i) = (within / half, within % half);
    h * head_rows + i * 2 + j
}

/// The Hugging Face row that GGUF row `gguf_row` holds (what an exporter writes there).
pub fn hf_row(gguf_row: usize, rows: usize, heads: usize) -> usize {
    let head_rows = rows / heads;
    let half = head_rows / 2;
    let (h, within) = (gguf_row / head_rows, gguf_row % head_rows);
    let (i, j) = (within / 2, within % 2);
    h * head_rows + j * half + i
}

/// Whether a matrix of `rows` rows can be permuted with `heads` heads.
pub fn fits(rows: usize, heads: usize) -> bool {
    heads > 0 && rows.is_multiple_of(2 * heads)
}

/// A row-major matrix of `rows` rows (each `data.len() / rows` elements: values, or the bytes of a
/// quantized row) reordered from Hugging Face's row order to llama.cpp's.
pub fn to_llama_cpp<T: Copy>(data: &[T], rows: usize, heads: usize) -> Vec<T> {
    reorder(data, rows, |r| hf_row(r, rows, heads))
}

/// The inverse of [`to_llama_cpp`]: a GGUF q/k matrix back in Hugging Face's row order.
pub fn from_llama_cpp<T: Copy>(data: &[T], rows: usize, heads: usize) -> Vec<T> {
    reorder(data, rows, |r| gguf_row(r, rows, heads))
}

/// Row `r` of the result is row `source(r)` of `data`.
fn reorder<T: Copy>(data: &[T], rows: usize, source: impl Fn(usize) -> usize) -> Vec<T> {
    let width = data.len() / rows;
    let mut out = Vec::with_capacity(data.len());
    for r in 0..rows {
        let s = source(r);
        out.extend_from_slice(&data[s * width..(s + 1) * width]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The converter's permutation written as numpy's reshape / swapaxes index arithmetic, as an
    /// oracle independent of the functions above: output row o = (h, i, j) in shape
    /// (n_head, half, 2) takes input row (h, j, i) in shape (n_head, 2, half).
    fn numpy_source_row(o: usize, rows: usize, heads: usize) -> usize {
        let half = rows / heads / 2;
        let (h, rest) = (o / (2 * half), o % (2 * half));
        let (i, j) = (rest / 2, rest % 2);
        h * 2 * half + j * half + i
    }

    #[test]
    fn both_directions_follow_the_converter_and_invert_each_other() {
        for (rows, heads) in [(24, 3), (8, 1), (64, 4), (32, 2)] {
            assert!(fits(rows, heads));
            for r in 0..rows {
                assert_eq!(hf_row(r, rows, heads), numpy_source_row(r, rows, heads), "rows {rows} heads {heads}");
                assert_eq!(hf_row(gguf_row(r, rows, heads), rows, heads), r);
                assert_eq!(gguf_row(hf_row(r, rows, heads), rows, heads), r);
            }
        }
        assert!(!fits(12, 4) && !fits(8, 0));
    }

    #[test]
    fn whole_rows_move() {
        // 2 heads of 4 rows: HF rows (h, j, i) -> GGUF rows (h, i, j).
        let rows: Vec<u8> = (0..8).collect();
        assert_eq!(to_llama_cpp(&rows, 8, 2), [0, 2, 1, 3, 4, 6, 5, 7]);
        let wide: Vec<u8> = (0..8).flat_map(|r| [r, r]).collect();
        let permuted = to_llama_cpp(&wide, 8, 1);
        assert_eq!(permuted, [0, 0, 4, 4, 1, 1, 5, 5, 2, 2, 6, 6, 3, 3, 7, 7]);
        assert_eq!(from_llama_cpp(&permuted, 8, 1), wide);
        let values: Vec<f32> = (0..64 * 3).map(|i| i as f32).collect();
        assert_eq!(from_llama_cpp(&to_llama_cpp(&values, 64, 4), 64, 4), values);
    }
}
