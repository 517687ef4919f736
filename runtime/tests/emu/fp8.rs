//! The emulator's model of cuBLASLt's FP8 GEMM (`Launcher::gemm_fp8`), on the host.

use tessera_runtime::backend::cuda::gemm::{gemm_ex_reference, ColMajorGemm};
use tessera_runtime::backend::cuda::{DType, GpuError};
use tessera_runtime::quant::fp8::from_e4m3;

use super::{read_elem, write_elem, EmuBuf, EmuLauncher};

/// What cuBLASLt's FP8 GEMM computes (`Launcher::gemm_fp8`): E4M3 codes (byte i of the buffer is
/// element i), products accumulated in f32 (in order over k here), times both scales, rounded to
/// bf16.
pub(super) fn gemm_fp8(
    l: &EmuLauncher,
    g: &ColMajorGemm,
    first: &EmuBuf,
    (first_scale, fso): (&EmuBuf, usize),
    second: &EmuBuf,
    (second_scale, sso): (&EmuBuf, usize),
    c: &EmuBuf,
) -> Result<(), GpuError> {
    g.check_fp8()?;
    let types = (
        first.dtype,
        second.dtype,
        first_scale.dtype,
        second_scale.dtype,
        c.dtype,
    );
    if types != (DType::U32, DType::U32, DType::F32, DType::F32, DType::Bf16) {
        return Err(GpuError::Shape {
            op: "FP8 GEMM".into(),
            problem: format!("operand types {types:?}"),
        });
    }
    let mut p = l.process();
    let (fa, sa) = (p.read(first.id), p.read(second.id));
    // TN: first is k × m (ld_first), second k × n (ld_second), c m × n (ldc).
    let (m, n) = (g.m as usize, g.n as usize);
    let bytes = [
        (g.ld_first as usize * m, fa.len()),
        (g.ld_second as usize * n, sa.len()),
        (g.ldc as usize * n, c.len),
    ];
    if let Some((want, have)) = bytes.iter().find(|(w, h)| w > h) {
        return Err(GpuError::Shape {
            op: "FP8 GEMM".into(),
            problem: format!("an operand of {have} elements where {want} are addressed"),
        });
    }
    let (fs, ss) = (p.read(first_scale.id), p.read(second_scale.id));
    let scale = read_elem(DType::F32, &fs, fso) * read_elem(DType::F32, &ss, sso);
    let mut cb = p.read(c.id);
    gemm_ex_reference(
        g,
        scale,
        &|i| from_e4m3(fa[i]),
        &|i| from_e4m3(sa[i]),
        0.0,
        &mut |i, v| {
            if let Some(v) = v {
                write_elem(DType::Bf16, &mut cb, i, v);
            }
            read_elem(DType::Bf16, &cb, i)
        },
    );
    p.write(c.id, &cb);
    Ok(())
}
