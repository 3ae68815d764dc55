//! Every instruction-set path this machine has, held to the scalar definitions, on sizes that
//! leave remainders everywhere (odd row counts, columns off the vector width, one token and many).

use cpu_kernels::pool::Pool;
use cpu_kernels::{
    argmax_rows, attention_causal, attention_decode, attention_decode_batch, attention_decode_part, decode_spans,
    matmul_f16, matmul_int4, matmul_int8, merge_decode_parts, scalar, AttentionShape, CacheElement, CausalQueries,
    F16Matrix, Int4Matrix, Int8Matrix, Isa, StepEntries, DECODE_PARTS, GROUP_SIZE,
};
use half::f16;

/// A small deterministic generator (xorshift), so failures reproduce.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn f32(&mut self) -> f32 {
        (self.next() % 20001) as f32 / 10000.0 - 1.0
    }
    fn f16_bits(&mut self, scale: f32) -> u16 {
        f16::from_f32(self.f32() * scale).to_bits()
    }
}

fn close(a: f32, b: f32, magnitude: f32) -> bool {
    (a - b).abs() <= 1e-5 * magnitude.max(1.0)
}

#[test]
fn matmul_f16_matches_scalar_on_every_path() {
    let mut rng = Rng(7);
    for pool in [Pool::new(1), Pool::new(3)] {
        for &(n, k, tokens) in &[
            (1, 1, 1),
            (5, 7, 1),
            (33, 40, 2),
            (17, 576, 1),
            (100, 131, 3),
            (64, 1536, 1),
            (40, 64, 4),
            (21, 77, 11),
            (9, 576, 16),
            (13, 40, 6),
            (6, 17, 7),
            // Blocked products: column chunks with a remainder, row tiles with one and two left,
            // token tiles with one to three left.
            (38, 600, 37),
            (40, 513, 8),
            (14, 9, 30),
            // The 512-bit tile: a pair of panels whose second is partial, a twelve-token tile and
            // one of one token.
            (27, 96, 13),
            // The f16 row tiles (2-16 tokens): the last tile of rows partial in every shape
            // (4, 6 and 3 rows), columns past the last whole register, both 512-bit shapes,
            // long rows (the next tile asked for ahead), and the first call past the tiles.
            (11, 23, 5),
            (25, 47, 14),
            (50, 2048, 12),
            (19, 300, 8),
            (7, 200, 17),
            // Short rows keep the tiles to 32 tokens; rows of 4096 give calls of 17 to the panels.
            (21, 100, 32),
            (9, 4096, 17),
        ] {
            let w: Vec<u16> = (0..n * k).map(|_| rng.f16_bits(1.0)).collect();
            let x: Vec<f32> = (0..tokens * k).map(|_| rng.f32()).collect();
            for isa in Isa::supported() {
                let mut out = vec![f32::NAN; tokens * n];
                matmul_f16(isa, &pool, &x, tokens, F16Matrix { rows: n, cols: k, data: &w }, &mut out).unwrap();
                for t in 0..tokens {
                    for row in 0..n {
                        let want = scalar::dot_f16(&x[t * k..(t + 1) * k], &w[row * k..(row + 1) * k]);
                        let got = out[t * n + row];
                        assert!(close(got, want, k as f32), "{isa:?} f16 [{n}x{k}] t{t} row {row}: {got} vs {want}");
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_int4_matches_scalar_on_every_path() {
    let mut rng = Rng(11);
    for pool in [Pool::new(1), Pool::new(2)] {
        for &(n, k, tokens) in &[
            (1, 32, 1),
            (3, 64, 2),
            (19, 288, 1),
            (50, 576, 1),
            (7, 1536, 4),
            (129, 96, 1),
            (33, 64, 5),
            (17, 576, 16),
            (5, 96, 3),
            (11, 160, 7),
            (4, 64, 9),
            (8, 64, 8),
            (38, 544, 37),
            (29, 800, 10),
            (27, 64, 25),
        ] {
            let groups = k / GROUP_SIZE;
            let packed: Vec<u8> = (0..n * k / 2).map(|_| rng.next() as u8).collect();
            let scales: Vec<u16> = (0..n * groups).map(|_| rng.f16_bits(0.1)).collect();
            let biases: Vec<u16> = (0..n * groups).map(|_| rng.f16_bits(0.5)).collect();
            let x: Vec<f32> = (0..tokens * k).map(|_| rng.f32()).collect();
            let w = Int4Matrix { rows: n, cols: k, packed: &packed, scales: &scales, biases: &biases };
            let (mut pp, mut ps, mut pb) =
                (vec![0u8; packed.len()], vec![0u16; scales.len()], vec![0u16; biases.len()]);
            cpu_kernels::int4_to_panels(w, &mut pp, &mut ps, &mut pb).unwrap();
            let panels = Int4Matrix { rows: n, cols: k, packed: &pp, scales: &ps, biases: &pb };
            for (isa, in_panels) in Isa::supported().into_iter().flat_map(|isa| [(isa, false), (isa, true)]) {
                let mut out = vec![f32::NAN; tokens * n];
                match in_panels {
                    false => matmul_int4(isa, &pool, &x, tokens, w, &mut out).unwrap(),
                    true => cpu_kernels::matmul_int4_panels(isa, &pool, &x, tokens, panels, &mut out).unwrap(),
                }
                for t in 0..tokens {
                    for row in 0..n {
                        let want = scalar::dot_int4(
                            &x[t * k..(t + 1) * k],
                            &packed[row * k / 2..(row + 1) * k / 2],
                            &scales[row * groups..(row + 1) * groups],
                            &biases[row * groups..(row + 1) * groups],
                            GROUP_SIZE,
                        );
                        let got = out[t * n + row];
                        // The fast paths carry activations to about 2^-30 of each group's largest
                        // magnitude: allow 2^-20 of the sum of the products' magnitudes.
                        let magnitude: f32 = (0..k)
                            .map(|i| {
                                let g = i / GROUP_SIZE;
                                let byte = packed[row * k / 2 + i / 2];
                                let q = if i % 2 == 0 { byte & 15 } else { byte >> 4 } as f32;
                                let s = f16::from_bits(scales[row * groups + g]).to_f32();
                                let b = f16::from_bits(biases[row * groups + g]).to_f32();
                                (x[t * k + i] * (s * q + b)).abs()
                            })
                            .sum();
                        assert!(
                            (got - want).abs() <= magnitude / 1048576.0 + 1e-6,
                            "{isa:?} int4 (panels: {in_panels}) [{n}x{k}] t{t} row {row}: {got} vs {want} (magnitude {magnitude})"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_int8_matches_scalar_on_every_path() {
    let mut rng = Rng(13);
    for pool in [Pool::new(1), Pool::new(2)] {
        for &(n, k, tokens) in &[
            (1, 32, 1),
            (3, 64, 2),
            (19, 288, 1),
            (50, 576, 1),
            (7, 1536, 4),
            (17, 576, 16),
            (5, 96, 3),
            (9, 64, 7),
            // A full 512-bit token block of eight, then one of two.
            (6, 96, 10),
            (31, 544, 23),
        ] {
            let groups = k / GROUP_SIZE;
            let codes: Vec<i8> = (0..n * k).map(|_| rng.next() as i8).collect();
            let scales: Vec<u16> = (0..n * groups).map(|_| rng.f16_bits(0.01)).collect();
            let x: Vec<f32> = (0..tokens * k).map(|_| rng.f32()).collect();
            let w = Int8Matrix { rows: n, cols: k, codes: &codes, scales: &scales };
            let (mut pc, mut ps) = (vec![0i8; codes.len()], vec![0u16; scales.len()]);
            cpu_kernels::int8_to_panels(w, &mut pc, &mut ps).unwrap();
            let panels = Int8Matrix { rows: n, cols: k, codes: &pc, scales: &ps };
            for (isa, in_panels) in Isa::supported().into_iter().flat_map(|isa| [(isa, false), (isa, true)]) {
                let mut out = vec![f32::NAN; tokens * n];
                match in_panels {
                    false => matmul_int8(isa, &pool, &x, tokens, w, &mut out).unwrap(),
                    true => cpu_kernels::matmul_int8_panels(isa, &pool, &x, tokens, panels, &mut out).unwrap(),
                }
                for t in 0..tokens {
                    for row in 0..n {
                        let (xr, cr) = (&x[t * k..(t + 1) * k], &codes[row * k..(row + 1) * k]);
                        let sr = &scales[row * groups..(row + 1) * groups];
                        let want = scalar::dot_int8(xr, cr, sr, GROUP_SIZE);
                        // Only the order of f32 operations differs (scale applied per group).
                        let magnitude: f32 = (0..k)
                            .map(|i| (xr[i] * f16::from_bits(sr[i / GROUP_SIZE]).to_f32() * cr[i] as f32).abs())
                            .sum();
                        let got = out[t * n + row];
                        assert!(
                            close(got, want, magnitude),
                            "{isa:?} int8 (panels: {in_panels}) [{n}x{k}] t{t} row {row}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
    // The scalar definition is the format's: weight = scale * code.
    let mut out = [0.0f32];
    let (codes, scales) = ([-3i8; 32], [f16::from_f32(0.5).to_bits()]);
    let w = Int8Matrix { rows: 1, cols: 32, codes: &codes, scales: &scales };
    matmul_int8(Isa::Scalar, &Pool::new(1), &[1.0; 32], 1, w, &mut out).unwrap();
    assert_eq!(out[0], -48.0);
    assert!(matmul_int8(Isa::Scalar, &Pool::new(1), &[1.0; 31], 1, w, &mut out).is_err());
}

#[test]
fn int4_scalar_definition_is_the_format() {
    // One group: q = 0..15 twice, element 2i in the low nibble; scale 0.5, bias -1.
    let packed: Vec<u8> = (0..16).map(|i| ((2 * i) % 16) as u8 | ((((2 * i + 1) % 16) as u8) << 4)).collect();
    let (s, b) = (f16::from_f32(0.5).to_bits(), f16::from_f32(-1.0).to_bits());
    for e in 0..32 {
        let mut x = vec![0.0f32; 32];
        x[e] = 1.0;
        let want = 0.5 * (e % 16) as f32 - 1.0;
        assert_eq!(scalar::dot_int4(&x, &packed, &[s], &[b], 32), want, "element {e}");
        for isa in Isa::supported() {
            let mut out = [0.0f32];
            let w = Int4Matrix { rows: 1, cols: 32, packed: &packed, scales: &[s], biases: &[b] };
            matmul_int4(isa, &Pool::new(1), &x, 1, w, &mut out).unwrap();
            assert_eq!(out[0], want, "{isa:?} element {e}");
        }
    }
}

/// A random KV cache of `shape` whose positions from `len` on hold NaN.
fn cache_filled_to(rng: &mut Rng, shape: AttentionShape, len: usize) -> (Vec<f32>, Vec<f32>) {
    let AttentionShape { kv_heads, head_dim: d, capacity: c, .. } = shape;
    let mut keys: Vec<f32> = (0..kv_heads * d * c).map(|_| rng.f32()).collect();
    let mut values: Vec<f32> = (0..kv_heads * c * d).map(|_| rng.f32()).collect();
    for kvh in 0..kv_heads {
        for j in 0..d {
            keys[kvh * d * c + j * c + len..kvh * d * c + (j + 1) * c].fill(f32::NAN);
        }
        values[kvh * c * d + len * d..(kvh + 1) * c * d].fill(f32::NAN);
    }
    (keys, values)
}

#[test]
fn attention_matches_scalar_and_reads_only_the_filled_span() {
    let mut rng = Rng(3);
    let pool = Pool::new(2);
    for &(heads, kv_heads, d, c, len) in &[
        (1, 1, 4, 8, 1),
        (9, 3, 64, 100, 37),
        (4, 2, 16, 64, 64),
        (32, 8, 64, 300, 250),
        (8, 2, 128, 200, 131),
        (9, 3, 64, 700, 513),
        (3, 3, 64, 64, 64),
        (2, 1, 64, 80, 1),
        // Long enough to be split into spans (merged softmax parts), and groups of more heads
        // than one pass takes (five of 64 values, seven of 128).
        (9, 3, 64, 2100, 2048),
        (9, 3, 64, 1200, 1029),
        (10, 2, 64, 1500, 1100),
        (28, 4, 128, 1300, 1290),
        (4, 1, 128, 600, 77),
    ] {
        let shape = AttentionShape { heads, kv_heads, head_dim: d, capacity: c };
        let q: Vec<f32> = (0..heads * d).map(|_| rng.f32()).collect();
        // Positions past `len` hold NaN: reading any of them would poison the result.
        let (keys, values) = cache_filled_to(&mut rng, shape, len);
        let group = heads / kv_heads;
        let mut scores = vec![0.0; len];
        for isa in Isa::supported() {
            let mut out = vec![f32::NAN; heads * d];
            attention_decode(isa, &pool, shape, &q, &keys, &values, len, &mut out).unwrap();
            for h in 0..heads {
                let kvh = h / group;
                let mut want = vec![0.0; d];
                scalar::attend_one(
                    &q[h * d..(h + 1) * d],
                    &keys[kvh * d * c..(kvh + 1) * d * c],
                    &values[kvh * c * d..(kvh + 1) * c * d],
                    c,
                    len,
                    1.0 / (d as f32).sqrt(),
                    &mut scores,
                    &mut want,
                );
                for j in 0..d {
                    let got = out[h * d + j];
                    assert!(close(got, want[j], 1.0), "{isa:?} head {h} [{j}]: {got} vs {}", want[j]);
                }
            }
        }
    }
}

#[test]
fn a_batch_of_decode_attentions_writes_its_entries_and_gives_each_sequence_its_solo_result() {
    let mut rng = Rng(11);
    for pool in [Pool::new(1), Pool::new(2), Pool::new(3)] {
        for &(heads, kv_heads, d, c) in &[(9, 3, 64, 2100), (32, 8, 64, 700), (8, 2, 128, 1200), (4, 4, 16, 64)] {
            let shape = AttentionShape { heads, kv_heads, head_dim: d, capacity: c };
            // Lengths from one position to the whole cache, long ones split into spans, groups
            // of up to eight heads taken in several passes: entries written inside the tasks and
            // before them.
            let lens: Vec<usize> = [1, c / 3, c, 17, c - 1, 64, 65].iter().map(|&n: &usize| n.clamp(1, c)).collect();
            let positions: Vec<usize> = lens.iter().map(|&len| len - 1).collect();
            // Filled up to the new entry's position, NaN from there on.
            let fresh: Vec<(Vec<f32>, Vec<f32>)> =
                positions.iter().map(|&p| cache_filled_to(&mut rng, shape, p)).collect();
            let per = heads * d;
            let q: Vec<f32> = (0..lens.len() * per).map(|_| rng.f32()).collect();
            let new_k: Vec<f32> = (0..lens.len() * kv_heads * d).map(|_| rng.f32()).collect();
            let new_v: Vec<f32> = (0..lens.len() * kv_heads * d).map(|_| rng.f32()).collect();
            let entries = StepEntries { keys: &new_k, values: &new_v, positions: &positions };
            for isa in Isa::supported() {
                let mut caches = fresh.clone();
                let mut views: Vec<(&mut [f32], &mut [f32])> =
                    caches.iter_mut().map(|(k, v)| (&mut k[..], &mut v[..])).collect();
                let mut out = vec![f32::NAN; lens.len() * per];
                attention_decode_batch(isa, &pool, shape, &q, entries, &mut views, &mut out).unwrap();
                for (s, ((keys, values), &p)) in caches.iter().zip(&positions).enumerate() {
                    for kvh in 0..kv_heads {
                        for j in 0..d {
                            let at = (s * kv_heads + kvh) * d + j;
                            assert_eq!(keys[(kvh * d + j) * c + p].to_bits(), new_k[at].to_bits(), "{isa:?} key");
                            assert_eq!(values[(kvh * c + p) * d + j].to_bits(), new_v[at].to_bits(), "{isa:?} value");
                        }
                    }
                    let mut alone = vec![f32::NAN; per];
                    attention_decode(isa, &pool, shape, &q[s * per..(s + 1) * per], keys, values, p + 1, &mut alone)
                        .unwrap();
                    let got = &out[s * per..(s + 1) * per];
                    assert!(
                        got.iter().zip(&alone).all(|(a, b)| a.to_bits() == b.to_bits()) && !got[0].is_nan(),
                        "{isa:?} {heads}/{kv_heads}x{d}, sequence {s} at position {p} differs from its solo result"
                    );
                }
            }
            let mut caches = fresh.clone();
            let mut views: Vec<(&mut [f32], &mut [f32])> =
                caches.iter_mut().map(|(k, v)| (&mut k[..], &mut v[..])).collect();
            let mut out = vec![0.0; lens.len() * per];
            let short = StepEntries { positions: &positions[1..], ..entries };
            assert!(attention_decode_batch(Isa::best(), &pool, shape, &q, short, &mut views, &mut out).is_err());
            let mut too_far = positions.clone();
            too_far[2] = c;
            let too_far = StepEntries { positions: &too_far, ..entries };
            assert!(attention_decode_batch(Isa::best(), &pool, shape, &q, too_far, &mut views, &mut out).is_err());
            let missing = StepEntries { keys: &new_k[1..], ..entries };
            assert!(attention_decode_batch(Isa::best(), &pool, shape, &q, missing, &mut views, &mut out).is_err());
        }
    }
}

#[test]
fn a_chunks_entries_land_at_their_positions_and_nothing_else_moves() {
    let mut rng = Rng(5);
    let shape = AttentionShape { heads: 9, kv_heads: 3, head_dim: 16, capacity: 40 };
    let AttentionShape { kv_heads, head_dim: d, capacity: c, .. } = shape;
    let (keys, values) = cache_filled_to(&mut rng, shape, 11);
    // Six rows of a bucket, four of them real, from position 11.
    let k: Vec<f32> = (0..6 * kv_heads * d).map(|_| rng.f32()).collect();
    let v: Vec<f32> = (0..6 * kv_heads * d).map(|_| rng.f32()).collect();
    let (mut written_k, mut written_v) = (keys.clone(), values.clone());
    cpu_kernels::write_cache_entries(shape, &mut written_k, &mut written_v, (&k, &v), 11, 4).unwrap();
    for kvh in 0..kv_heads {
        for j in 0..d {
            for p in 0..c {
                let (at_k, at_v) = ((kvh * d + j) * c + p, (kvh * c + p) * d + j);
                let (want_k, want_v) = if (11..15).contains(&p) {
                    let row = ((p - 11) * kv_heads + kvh) * d + j;
                    (k[row], v[row])
                } else {
                    (keys[at_k], values[at_v])
                };
                assert_eq!(written_k[at_k].to_bits(), want_k.to_bits(), "key {kvh} {j} at {p}");
                assert_eq!(written_v[at_v].to_bits(), want_v.to_bits(), "value {kvh} {j} at {p}");
            }
        }
    }
    // Rows past the cache, and fewer entries than rows, are refused.
    assert!(cpu_kernels::write_cache_entries(shape, &mut written_k, &mut written_v, (&k, &v), 37, 4).is_err());
    assert!(cpu_kernels::write_cache_entries(shape, &mut written_k, &mut written_v, (&k, &v), 0, 7).is_err());
}

#[test]
fn argmax_rows_matches_scalar_with_ties_nan_and_infinities() {
    let mut rng = Rng(13);
    for pool in [Pool::new(1), Pool::new(2), Pool::new(3)] {
        for &(rows, cols) in &[(1, 1), (1, 17), (3, 37), (8, 49152), (9, 100)] {
            let mut logits: Vec<f32> = (0..rows * cols).map(|_| rng.f32()).collect();
            for r in 0..rows {
                let row = &mut logits[r * cols..(r + 1) * cols];
                match r % 5 {
                    // The largest value twice: the first wins.
                    0 if cols > 3 => {
                        row[cols - 1] = 9.0;
                        row[cols / 2] = 9.0;
                    }
                    // NaN never wins, even ahead of the largest value.
                    1 => {
                        row[0] = f32::NAN;
                        row[cols - 1] = f32::NAN;
                    }
                    // Nothing above -inf (NaN first): index 0, as the scalar loop never moves.
                    2 => {
                        row.fill(f32::NEG_INFINITY);
                        row[0] = f32::NAN;
                    }
                    3 => row[cols / 3] = f32::INFINITY,
                    _ => {}
                }
            }
            for isa in Isa::supported() {
                let mut out = vec![u32::MAX; rows];
                argmax_rows(isa, &pool, &logits, cols, &mut out).unwrap();
                for (r, &got) in out.iter().enumerate() {
                    let want = scalar::argmax(&logits[r * cols..(r + 1) * cols]);
                    assert_eq!(got, want, "{isa:?} row {r} of {rows} x {cols}");
                }
            }
        }
    }
    assert!(argmax_rows(Isa::best(), &Pool::new(1), &[0.0; 5], 2, &mut [0; 3]).is_err());
}

#[test]
fn shapes_that_disagree_are_errors() {
    let pool = Pool::new(1);
    let w = [0u16; 6];
    let mut out = [0.0f32; 2];
    assert!(matmul_f16(Isa::Scalar, &pool, &[0.0; 4], 1, F16Matrix { rows: 2, cols: 3, data: &w }, &mut out).is_err());
    let int4 = Int4Matrix { rows: 1, cols: 16, packed: &[0; 8], scales: &[0], biases: &[0] };
    assert!(matmul_int4(Isa::Scalar, &pool, &[0.0; 16], 1, int4, &mut out[..1]).is_err());
    let shape = AttentionShape { heads: 3, kv_heads: 2, head_dim: 1, capacity: 1 };
    assert!(attention_decode(Isa::Scalar, &pool, shape, &[0.0; 3], &[0.0; 2], &[0.0; 2], 1, &mut [0.0; 3]).is_err());
    let shape = AttentionShape { heads: 1, kv_heads: 1, head_dim: 1, capacity: 2 };
    assert!(attention_decode(Isa::Scalar, &pool, shape, &[0.0], &[0.0; 2], &[0.0; 2], 3, &mut [0.0]).is_err());
}

#[test]
fn causal_attention_matches_scalar_row_by_row_and_reads_only_visible_positions() {
    let mut rng = Rng(5);
    let pool = Pool::new(2);
    // (heads, kv_heads, head_dim, capacity, tokens, position, real rows)
    for &(heads, kv_heads, d, c, tokens, position, rows) in &[
        (1, 1, 4, 8, 3, 0, 3),
        (9, 3, 64, 100, 16, 20, 16),
        (4, 2, 16, 64, 37, 5, 30),
        (6, 6, 8, 40, 5, 35, 5),
        (8, 2, 32, 50, 13, 30, 11),
        (3, 1, 16, 17, 2, 0, 2),
    ] {
        let shape = AttentionShape { heads, kv_heads, head_dim: d, capacity: c };
        let q: Vec<f32> = (0..tokens * heads * d).map(|_| rng.f32()).collect();
        // Positions past the last real row hold NaN: reading any of them would poison the result
        // (each row must also stay off the positions after its own: checked against the scalar).
        let (keys, values) = cache_filled_to(&mut rng, shape, position + rows);
        let group = heads / kv_heads;
        let mut scores = vec![0.0; c];
        for isa in Isa::supported() {
            let mut out = vec![f32::NAN; tokens * heads * d];
            let queries = CausalQueries { tokens, position, rows };
            attention_causal(isa, &pool, shape, &q, queries, &keys, &values, &mut out).unwrap();
            for t in 0..tokens {
                for h in 0..heads {
                    let at = (t * heads + h) * d;
                    let mut want = vec![0.0; d];
                    if t < rows {
                        let kvh = h / group;
                        scalar::attend_one(
                            &q[at..at + d],
                            &keys[kvh * d * c..(kvh + 1) * d * c],
                            &values[kvh * c * d..(kvh + 1) * c * d],
                            c,
                            position + t + 1,
                            1.0 / (d as f32).sqrt(),
                            &mut scores,
                            &mut want,
                        );
                    }
                    for j in 0..d {
                        let got = out[at + j];
                        assert!(close(got, want[j], 1.0), "{isa:?} row {t} head {h} [{j}]: {got} vs {}", want[j]);
                    }
                }
            }
        }
        let too_far = CausalQueries { tokens, position: c - rows + 1, rows };
        let mut out = vec![0.0; tokens * heads * d];
        assert!(attention_causal(Isa::Scalar, &pool, shape, &q, too_far, &keys, &values, &mut out).is_err());
    }
}

/// `cache` rounded to f16, and those rounded values widened back: an f16 cache and the f32 cache
/// that holds the same entries (NaN stays NaN).
/// One KV head's decode parts, merged, against the one-thread `attention_decode` of that head:
/// the same bits, the unused parts empty, and no part but the last filled one reading the
/// newest position (the one a runtime writes just before, in the unit of that part).
fn decode_parts_match_one_thread<E: CacheElement>(isa: Isa, shape: AttentionShape, len: usize, seed: u64) {
    let mut rng = Rng(seed);
    let AttentionShape { heads, kv_heads, head_dim: d, capacity: c } = shape;
    let group = heads / kv_heads;
    let (keys, values) = cache_filled_to(&mut rng, shape, len);
    let to_e = |x: &[f32]| {
        let mut out = vec![E::default(); x.len()];
        E::round_into(x, &mut out);
        out
    };
    let (keys, values) = (to_e(&keys), to_e(&values));
    let q: Vec<f32> = (0..heads * d).map(|_| rng.f32()).collect();
    let one = AttentionShape { heads: group, kv_heads: 1, head_dim: d, capacity: c };
    let spans = decode_spans(isa, one, len);
    assert!((1..=DECODE_PARTS).contains(&spans));
    // The newest position poisoned, for the parts before the last filled one.
    let (mut poisoned_keys, mut poisoned_values) = (keys.clone(), values.clone());
    for kvh in 0..kv_heads {
        for j in 0..d {
            poisoned_keys[(kvh * d + j) * c + len - 1] = E::from_f32(f32::NAN);
        }
        for j in 0..d {
            poisoned_values[(kvh * c + len - 1) * d + j] = E::from_f32(f32::NAN);
        }
    }
    for kvh in 0..kv_heads {
        let stride = 2 + d;
        let mut parts = vec![f32::NAN; DECODE_PARTS * group * stride];
        for part in 0..DECODE_PARTS {
            let (k, v) = if part + 1 < spans { (&poisoned_keys, &poisoned_values) } else { (&keys, &values) };
            let head = |x: &[E], span: usize| x[kvh * span..(kvh + 1) * span].to_vec();
            let out = &mut parts[part * group * stride..(part + 1) * group * stride];
            let qk = &q[kvh * group * d..(kvh + 1) * group * d];
            attention_decode_part(isa, one, qk, &head(k, d * c), &head(v, c * d), len, part, out).unwrap();
            let filled = out.chunks_exact(stride).all(|h| h[1] > 0.0 && h.iter().all(|x| !x.is_nan()));
            let empty = out.chunks_exact(stride).all(|h| h[1] == 0.0);
            assert!(if part < spans { filled } else { empty }, "{isa:?} {shape:?} len {len} part {part}");
        }
        let mut got = vec![f32::NAN; group * d];
        merge_decode_parts(&parts, group, d, &mut got).unwrap();
        let mut want = vec![f32::NAN; group * d];
        let (k, v) = (&keys[kvh * d * c..(kvh + 1) * d * c], &values[kvh * c * d..(kvh + 1) * c * d]);
        let qk = &q[kvh * group * d..(kvh + 1) * group * d];
        attention_decode(isa, &Pool::new(1), one, qk, k, v, len, &mut want).unwrap();
        assert!(
            same_bits(&got, &want),
            "{isa:?} {shape:?} len {len} KV head {kvh}: {:?} vs {:?}",
            &got[..4],
            &want[..4]
        );
    }
}

#[test]
fn decode_parts_merged_give_the_one_thread_attention_bit_for_bit() {
    for &(heads, kv_heads, d, c, len) in &[
        (9, 3, 64, 100, 1),
        (9, 3, 64, 2100, 37),
        (9, 3, 64, 2100, 1023),
        (9, 3, 64, 2100, 1024),
        (9, 3, 64, 2100, 1900),
        (32, 8, 64, 1500, 1400),
        (28, 4, 128, 1300, 1290),
        (8, 2, 16, 300, 131),
        (4, 1, 128, 600, 77),
    ] {
        let shape = AttentionShape { heads, kv_heads, head_dim: d, capacity: c };
        for isa in Isa::supported() {
            decode_parts_match_one_thread::<f32>(isa, shape, len, 5 + len as u64);
            decode_parts_match_one_thread::<f16>(isa, shape, len, 7 + len as u64);
        }
    }
    // Shapes that disagree are errors, not panics.
    let one = AttentionShape { heads: 3, kv_heads: 1, head_dim: 64, capacity: 16 };
    let (q, keys, mut out) = (vec![0.0; 3 * 64], vec![0.0f32; 64 * 16], vec![0.0; 3 * 66]);
    assert!(attention_decode_part(Isa::best(), one, &q, &keys, &keys, 17, 0, &mut out).is_err());
    assert!(attention_decode_part(Isa::best(), one, &q, &keys, &keys, 0, 0, &mut out).is_err());
    assert!(attention_decode_part(Isa::best(), one, &q, &keys, &keys, 4, DECODE_PARTS, &mut out).is_err());
    assert!(attention_decode_part(Isa::best(), one, &q, &keys, &keys, 4, 0, &mut out[1..]).is_err());
    let two = AttentionShape { kv_heads: 2, ..one };
    assert!(attention_decode_part(Isa::best(), two, &q, &keys, &keys, 4, 0, &mut out).is_err());
    let empty = vec![0.0; DECODE_PARTS * 3 * 66];
    assert!(merge_decode_parts(&empty, 3, 64, &mut vec![0.0; 3 * 64]).is_err());
}

fn rounded(cache: &[f32]) -> (Vec<f16>, Vec<f32>) {
    let half: Vec<f16> = cache.iter().map(|&x| f16::from_f32(x)).collect();
    let wide = half.iter().map(|x| x.to_f32()).collect();
    (half, wide)
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()) && a.len() == b.len()
}

#[test]
fn f16_caches_give_what_f32_caches_of_the_same_rounded_entries_give() {
    let mut rng = Rng(17);
    let pool = Pool::new(2);
    // Decode (grouped passes, spans of long contexts, the scalar path) and batched decode.
    for &(heads, kv_heads, d, c, len) in
        &[(9, 3, 64, 100, 37), (8, 2, 128, 200, 131), (9, 3, 64, 1200, 1029), (4, 4, 16, 64, 5)]
    {
        let shape = AttentionShape { heads, kv_heads, head_dim: d, capacity: c };
        let q: Vec<f32> = (0..heads * d).map(|_| rng.f32()).collect();
        let (keys, values) = cache_filled_to(&mut rng, shape, len);
        let ((k16, k32), (v16, v32)) = (rounded(&keys), rounded(&values));
        for isa in Isa::supported() {
            let (mut half, mut full) = (vec![f32::NAN; heads * d], vec![f32::NAN; heads * d]);
            attention_decode(isa, &pool, shape, &q, &k16, &v16, len, &mut half).unwrap();
            attention_decode(isa, &pool, shape, &q, &k32, &v32, len, &mut full).unwrap();
            assert!(same_bits(&half, &full) && !half[0].is_nan(), "{isa:?} decode {heads}/{kv_heads}x{d} at {len}");
        }
        // A batch of three: each writes its new entry (rounded) at its position, then attends.
        let positions = [len - 1, len.min(c - 1), 0];
        let fresh: Vec<_> = positions.iter().map(|&p| cache_filled_to(&mut rng, shape, p)).collect();
        let per = heads * d;
        let q: Vec<f32> = (0..3 * per).map(|_| rng.f32()).collect();
        let new_k: Vec<f32> = (0..3 * kv_heads * d).map(|_| rng.f32()).collect();
        let new_v: Vec<f32> = (0..3 * kv_heads * d).map(|_| rng.f32()).collect();
        let (rounded_k, rounded_v) = (rounded(&new_k).1, rounded(&new_v).1);
        for isa in Isa::supported() {
            let mut halves: Vec<(Vec<f16>, Vec<f16>)> =
                fresh.iter().map(|(k, v)| (rounded(k).0, rounded(v).0)).collect();
            let mut fulls: Vec<(Vec<f32>, Vec<f32>)> =
                fresh.iter().map(|(k, v)| (rounded(k).1, rounded(v).1)).collect();
            let mut half_views: Vec<(&mut [f16], &mut [f16])> =
                halves.iter_mut().map(|(k, v)| (&mut k[..], &mut v[..])).collect();
            let mut full_views: Vec<(&mut [f32], &mut [f32])> =
                fulls.iter_mut().map(|(k, v)| (&mut k[..], &mut v[..])).collect();
            let (mut half, mut full) = (vec![f32::NAN; 3 * per], vec![f32::NAN; 3 * per]);
            let entries = StepEntries { keys: &new_k, values: &new_v, positions: &positions };
            attention_decode_batch(isa, &pool, shape, &q, entries, &mut half_views, &mut half).unwrap();
            let entries = StepEntries { keys: &rounded_k, values: &rounded_v, positions: &positions };
            attention_decode_batch(isa, &pool, shape, &q, entries, &mut full_views, &mut full).unwrap();
            assert!(same_bits(&half, &full), "{isa:?} batch {heads}/{kv_heads}x{d}");
            for ((hk, hv), (fk, fv)) in halves.iter().zip(&fulls) {
                let widened = |x: &[f16]| x.iter().map(|h| h.to_f32()).collect::<Vec<f32>>();
                assert!(same_bits(&widened(hk), fk) && same_bits(&widened(hv), fv), "{isa:?} written entries");
            }
        }
    }
    // Causal rows (a prefill chunk): the f16 caches widened over the visible positions.
    for &(heads, kv_heads, d, c, tokens, position, rows) in
        &[(9, 3, 64, 100, 16, 20, 16), (4, 2, 16, 64, 37, 5, 30), (8, 2, 32, 50, 13, 30, 11), (9, 3, 64, 80, 1, 40, 1)]
    {
        let shape = AttentionShape { heads, kv_heads, head_dim: d, capacity: c };
        let q: Vec<f32> = (0..tokens * heads * d).map(|_| rng.f32()).collect();
        let (keys, values) = cache_filled_to(&mut rng, shape, position + rows);
        let ((k16, k32), (v16, v32)) = (rounded(&keys), rounded(&values));
        let queries = CausalQueries { tokens, position, rows };
        for isa in Isa::supported() {
            let (mut half, mut full) = (vec![f32::NAN; tokens * heads * d], vec![f32::NAN; tokens * heads * d]);
            attention_causal(isa, &pool, shape, &q, queries, &k16, &v16, &mut half).unwrap();
            attention_causal(isa, &pool, shape, &q, queries, &k32, &v32, &mut full).unwrap();
            assert!(
                same_bits(&half, &full) && !half[0].is_nan(),
                "{isa:?} causal {heads}/{kv_heads}x{d}, {rows} rows at {position}"
            );
        }
    }
}

/// The int8-activation products equal the exact scalar products over the rounded activations
/// (`round_int8`) on every path, up to the order of f32 operations: the VNNI rows with every
/// token block (one to eight, then a remainder), partial 64-byte blocks (576 and 544 columns),
/// and the exact kernels over a rounded copy elsewhere.
#[test]
fn int8_activation_products_match_scalar_over_rounded_activations() {
    let mut rng = Rng(19);
    for pool in [Pool::new(1), Pool::new(2)] {
        for &(n, k, tokens) in &[
            (1, 32, 1),
            (19, 288, 1),
            (50, 576, 1),
            (7, 1536, 2),
            (17, 576, 8),
            (11, 160, 5),
            (38, 544, 19),
            (9, 64, 12),
            (48, 576, 8),
            (37, 96, 30),
        ] {
            let groups = k / GROUP_SIZE;
            let packed: Vec<u8> = (0..n * k / 2).map(|_| rng.next() as u8).collect();
            let codes: Vec<i8> = (0..n * k).map(|_| rng.next() as i8).collect();
            let scales: Vec<u16> = (0..n * groups).map(|_| rng.f16_bits(0.1)).collect();
            let biases: Vec<u16> = (0..n * groups).map(|_| rng.f16_bits(0.5)).collect();
            // Groups of very different magnitudes, one of zeros, as activations have.
            let x: Vec<f32> = (0..tokens * k)
                .map(|i| match (i / GROUP_SIZE) % 4 {
                    0 => rng.f32() * 40.0,
                    1 => rng.f32() * 0.01,
                    2 if i % (3 * GROUP_SIZE) < GROUP_SIZE => 0.0,
                    _ => rng.f32(),
                })
                .collect();
            let mut rounded = vec![0.0; x.len()];
            cpu_kernels::round_int8(&x, &mut rounded);
            let w4 = Int4Matrix { rows: n, cols: k, packed: &packed, scales: &scales, biases: &biases };
            let w8 = Int8Matrix { rows: n, cols: k, codes: &codes, scales: &scales };
            let (mut pp, mut ps, mut pb) =
                (vec![0u8; packed.len()], vec![0u16; scales.len()], vec![0u16; biases.len()]);
            cpu_kernels::int4_to_panels(w4, &mut pp, &mut ps, &mut pb).unwrap();
            let panels = Int4Matrix { rows: n, cols: k, packed: &pp, scales: &ps, biases: &pb };
            let (mut pc, mut ps8) = (vec![0i8; codes.len()], vec![0u16; scales.len()]);
            cpu_kernels::int8_to_panels(w8, &mut pc, &mut ps8).unwrap();
            let panels8 = Int8Matrix { rows: n, cols: k, codes: &pc, scales: &ps8 };
            for isa in Isa::supported() {
                let mut out4 = vec![f32::NAN; tokens * n];
                cpu_kernels::matmul_int4_q8(isa, &pool, &x, tokens, w4, &mut out4).unwrap();
                let mut outp = vec![f32::NAN; tokens * n];
                cpu_kernels::matmul_int4_panels_q8(isa, &pool, &x, tokens, panels, &mut outp).unwrap();
                let mut outp8 = vec![f32::NAN; tokens * n];
                cpu_kernels::matmul_int8_panels_q8(isa, &pool, &x, tokens, panels8, &mut outp8).unwrap();
                let mut out8 = vec![f32::NAN; tokens * n];
                cpu_kernels::matmul_int8_q8(isa, &pool, &x, tokens, w8, &mut out8).unwrap();
                for t in 0..tokens {
                    let xr = &rounded[t * k..(t + 1) * k];
                    for row in 0..n {
                        let (s, b) =
                            (&scales[row * groups..(row + 1) * groups], &biases[row * groups..(row + 1) * groups]);
                        let p = &packed[row * k / 2..(row + 1) * k / 2];
                        let c = &codes[row * k..(row + 1) * k];
                        let want4 = scalar::dot_int4(xr, p, s, b, GROUP_SIZE);
                        let want8 = scalar::dot_int8(xr, c, s, GROUP_SIZE);
                        let magnitude4: f32 = (0..k)
                            .map(|i| {
                                let byte = p[i / 2];
                                let q = if i % 2 == 0 { byte & 15 } else { byte >> 4 } as f32;
                                let g = i / GROUP_SIZE;
                                (xr[i] * (f16::from_bits(s[g]).to_f32() * q + f16::from_bits(b[g]).to_f32())).abs()
                            })
                            .sum();
                        let magnitude8: f32 = (0..k)
                            .map(|i| (xr[i] * f16::from_bits(s[i / GROUP_SIZE]).to_f32() * c[i] as f32).abs())
                            .sum();
                        for (kind, got, want, magnitude) in [
                            ("int4", out4[t * n + row], want4, magnitude4),
                            ("int4 panels", outp[t * n + row], want4, magnitude4),
                            ("int8 panels", outp8[t * n + row], want8, magnitude8),
                            ("int8", out8[t * n + row], want8, magnitude8),
                        ] {
                            assert!(
                                (got - want).abs() <= magnitude / 1048576.0 + 1e-6,
                                "{isa:?} {kind} q8 [{n}x{k}] t{t} row {row}: {got} vs {want} (magnitude {magnitude})"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The panel layout is the documented one, and laying it back out gives the row-major matrix.
#[test]
fn int4_panels_are_their_layout_and_round_trip() {
    let mut rng = Rng(23);
    for &(n, k) in &[(16, 64), (35, 96), (5, 32)] {
        let groups = k / GROUP_SIZE;
        let packed: Vec<u8> = (0..n * k / 2).map(|_| rng.next() as u8).collect();
        let scales: Vec<u16> = (0..n * groups).map(|_| rng.next() as u16).collect();
        let biases: Vec<u16> = (0..n * groups).map(|_| rng.next() as u16).collect();
        let w = Int4Matrix { rows: n, cols: k, packed: &packed, scales: &scales, biases: &biases };
        let (mut pp, mut ps, mut pb) = (vec![0u8; packed.len()], vec![0u16; scales.len()], vec![0u16; biases.len()]);
        cpu_kernels::int4_to_panels(w, &mut pp, &mut ps, &mut pb).unwrap();
        // Row r of panel p, group g, chunk c: 16 p k / 2 + 16 w g + 4 w c + 4 r.
        for row in 0..n {
            let (p, r) = (row / 16, row % 16);
            let width = 16.min(n - 16 * p);
            for byte in 0..k / 2 {
                let (g, c, j) = (byte / 16, byte % 16 / 4, byte % 4);
                let at = 16 * p * k / 2 + 16 * width * g + 4 * width * c + 4 * r + j;
                assert_eq!(pp[at], packed[row * k / 2 + byte], "[{n}x{k}] row {row} byte {byte}");
            }
            for g in 0..groups {
                assert_eq!(ps[16 * p * groups + width * g + r], scales[row * groups + g]);
                assert_eq!(pb[16 * p * groups + width * g + r], biases[row * groups + g]);
            }
        }
        let panels = Int4Matrix { rows: n, cols: k, packed: &pp, scales: &ps, biases: &pb };
        let (mut rp, mut rs, mut rb) = (vec![0u8; packed.len()], vec![0u16; scales.len()], vec![0u16; biases.len()]);
        cpu_kernels::int4_from_panels(panels, &mut rp, &mut rs, &mut rb).unwrap();
        assert_eq!((rp, rs, rb), (packed, scales.clone(), biases));
        // int8: chunk c of group g (32 codes) at 16 p k + 32 w g + 4 w c + 4 r.
        let codes: Vec<i8> = (0..n * k).map(|_| rng.next() as i8).collect();
        let w8 = Int8Matrix { rows: n, cols: k, codes: &codes, scales: &scales };
        let (mut pc, mut ps) = (vec![0i8; codes.len()], vec![0u16; scales.len()]);
        cpu_kernels::int8_to_panels(w8, &mut pc, &mut ps).unwrap();
        for row in 0..n {
            let (p, r) = (row / 16, row % 16);
            let width = 16.min(n - 16 * p);
            for i in 0..k {
                let (g, c, j) = (i / 32, i % 32 / 4, i % 4);
                let at = 16 * p * k + 32 * width * g + 4 * width * c + 4 * r + j;
                assert_eq!(pc[at], codes[row * k + i], "int8 [{n}x{k}] row {row} code {i}");
            }
        }
        let panels8 = Int8Matrix { rows: n, cols: k, codes: &pc, scales: &ps };
        let (mut rc, mut rs8) = (vec![0i8; codes.len()], vec![0u16; scales.len()]);
        cpu_kernels::int8_from_panels(panels8, &mut rc, &mut rs8).unwrap();
        assert_eq!((rc, rs8), (codes, scales));
    }
}

/// `round_int8` is its definition: per group, the nearest multiple (ties to even) of the
/// largest magnitude / 127; a group of zeros stays zeros.
#[test]
fn round_int8_is_its_definition() {
    let mut x = [0.0f32; 64];
    x[0] = 127.0;
    x[1] = -2.5;
    x[2] = 3.5;
    x[3] = 0.49;
    x[4] = -127.0;
    let mut out = [f32::NAN; 64];
    cpu_kernels::round_int8(&x, &mut out);
    assert_eq!(&out[..5], &[127.0, -2.0, 4.0, 0.0, -127.0]);
    assert!(out[5..].iter().all(|&v| v == 0.0));
}
