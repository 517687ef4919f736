//! Row moves by index: expert parallelism's dispatch (tokens to their experts' rows) and
//! combine (the experts' outputs back onto their tokens, weighted). Rows of `c` floats; the
//! index lists come from the router, so they are host slices on every backend.

/// `dst (rows.len(), c)`: row `i` = `src` row `rows[i]`, times `scale[i]` when given.
pub fn gather_rows(dst: &mut [f32], src: &[f32], rows: &[usize], scale: Option<&[f32]>, c: usize) {
    for (i, (o, &r)) in dst.chunks_exact_mut(c).zip(rows).enumerate() {
        let v = &src[r * c..(r + 1) * c];
        match scale {
            None => o.copy_from_slice(v),
            Some(w) => o.iter_mut().zip(v).for_each(|(o, v)| *o = w[i] * v),
        }
    }
}

/// `dst` row `to[i]` += `scale[i]` · `src` row `from[i]`, for each `i` in order (the order
/// every element's sum is taken in).
pub fn scatter_add_rows(
    dst: &mut [f32],
    src: &[f32],
    to: &[usize],
    from: &[usize],
    scale: &[f32],
    c: usize,
) {
    for ((&t, &f), &w) in to.iter().zip(from).zip(scale) {
        let v = &src[f * c..(f + 1) * c];
        let o = &mut dst[t * c..(t + 1) * c];
        o.iter_mut().zip(v).for_each(|(o, v)| *o += w * v);
    }
}
