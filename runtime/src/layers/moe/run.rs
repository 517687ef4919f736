//! The MoE layer's forward and backward on a backend: GEMMs on its buffers, rows moved by
//! index with `gather_rows` / `scatter_add_rows`, tokens between EP ranks with the EP group's
//! `all_to_all_v`. The routing and the row plan are host vectors (`route`, `dispatch_plan`).
//!
//! On the CPU every step is the host code this layer was first written as, in the same order,
//! so a CPU run is bit for bit what it was: a gather is a row copy (or `w · row`), a combine
//! adds `w · row` per slot in token-then-slot order, and a one-rank EP group's exchanges (the
//! identity) are skipped.

use super::{MoeMlp, MoeSaved, MoeWorkspace};
use crate::backend::{scratch, Backend, Storage};
use crate::layers::LayerError;

/// `slot`'s activation buffer as a write view of `len` elements (grown when shorter; a device
/// allocates no empty buffer, so at least one element).
fn grow<'a, B: Backend>(
    be: &B,
    slot: &'a mut Option<B::Buf>,
    len: usize,
) -> Result<B::Mut<'a>, LayerError> {
    let v = scratch(be, slot, Storage::Bf16, len.max(1))?;
    Ok(B::sub_mut(v, 0..len))
}

/// The first `len` elements of a buffer the forward filled.
fn kept<'a, B: Backend>(slot: &'a Option<B::Buf>, len: usize) -> Result<B::Ref<'a>, LayerError> {
    let b = slot
        .as_ref()
        .ok_or_else(|| LayerError::Config("an MoE backward without its forward".into()))?;
    Ok(B::sub(B::view(b), 0..len))
}

/// A fresh activation buffer of `len` elements (at least one).
fn fresh<B: Backend>(be: &B, len: usize) -> Result<B::Buf, LayerError> {
    Ok(be.alloc(Storage::Bf16, len.max(1))?)
}

fn head<B: Backend>(b: &B::Buf, len: usize) -> B::Ref<'_> {
    B::sub(B::view(b), 0..len)
}

fn head_mut<B: Backend>(b: &mut B::Buf, len: usize) -> B::Mut<'_> {
    B::sub_mut(B::view_mut(b), 0..len)
}

/// Host values as an activation buffer.
fn upload<B: Backend>(be: &B, x: &[f32]) -> Result<B::Buf, LayerError> {
    Ok(be.upload(Storage::Bf16, x)?)
}

fn sigmoid(v: f32) -> f32 {
    1.0 / (1.0 + (-v).exp())
}

impl MoeMlp {
    /// The forward of `x (n, C)` (every token of the TP group), keeping in `s` what the
    /// backward needs; with `out`, writes this TP rank's partial output `(n, C)`.
    pub fn forward<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        x: B::Ref<'_>,
        s: &mut MoeSaved<B>,
        out: Option<B::Mut<'_>>,
        ws: &mut MoeWorkspace<B>,
    ) -> Result<(), LayerError> {
        let (c, e, k) = (self.c, self.spec.experts, self.spec.top_k);
        let n = B::len(x) / c;
        let (ep_rank, ep_size) = ws.ep_rank();
        if ep_size != self.ep.size || ep_rank != self.ep.rank {
            return Err(LayerError::Config(format!(
                "MoE layer built for EP rank {} of {}, run on rank {ep_rank} of {ep_size}",
                self.ep.rank, self.ep.size,
            )));
        }
        // The router's GEMM on the backend, its scores and top-k on the host.
        let logits = self.project(be, x, self.router.view::<B>(p), n, e)?;
        let bias = self
            .score_bias
            .map(|b| be.download(b.view::<B>(p)))
            .transpose()?;
        s.routing = self.spec.route(&logits, bias.as_deref());
        // The load-balancing statistics of the whole micro-batch.
        let mut stats = [s.routing.counts.clone(), s.routing.prob_sums.clone()].concat();
        let mut tokens = n;
        if let Some(cp) = &ws.cp {
            cp.all_reduce_sum(&mut stats)?;
            tokens *= cp.size();
        }
        s.aux = self
            .spec
            .aux_loss(self.aux_coef, &stats[..e], &stats[e..], tokens);
        s.counts = stats[..e].to_vec();
        s.tokens = tokens;
        self.dispatch_plan(be, s, ws)?;
        // Dispatch: rows in `order`, to the EP rank holding each expert.
        let sent = s.order.len();
        let tokens_of: Vec<usize> = s.order.iter().map(|&slot| slot / k).collect();
        let mut send = fresh(be, sent * c)?;
        be.gather_rows(head_mut::<B>(&mut send, sent * c), x, &tokens_of, None, c)?;
        let recv = self.exchange(be, ws, send, &s.send_rows, &s.recv_rows)?;
        let rows = s.perm.len();
        let xin = grow(be, &mut s.xin, rows * c)?;
        be.gather_rows(xin, head::<B>(&recv, rows * c), &s.perm, None, c)?;
        // The experts.
        let (hw, fl) = self.widths();
        let pe = B::sub(p, self.expert_base..B::len(p));
        let mut y = fresh(be, rows * c)?;
        {
            let xin = kept::<B>(&s.xin, rows * c)?;
            let mut h = grow(be, &mut s.h, rows * hw)?;
            let mut a = grow(be, &mut s.a, rows * fl)?;
            for (mlp, r) in self.experts.iter().zip(&s.expert_rows) {
                if r.is_empty() {
                    continue;
                }
                let xe = B::sub(xin, r.start * c..r.end * c);
                let he = B::sub_mut(B::rb(&mut h), r.start * hw..r.end * hw);
                let mut ae = B::sub_mut(B::rb(&mut a), r.start * fl..r.end * fl);
                mlp.forward_hidden(be, pe, xe, he, B::rb(&mut ae))?;
                let mut ye = B::sub_mut(B::view_mut(&mut y), r.start * c..r.end * c);
                mlp.proj
                    .forward_partial(be, pe, B::ro(&ae), B::rb(&mut ye))?;
                if self.lead() {
                    mlp.proj.add_bias(be, pe, ye)?;
                }
            }
        }
        // Combine: back to the received order, home, then weighted per token.
        let back = self.reorder(be, &y, &s.unperm)?;
        s.y_back = Some(self.exchange(be, ws, back, &s.recv_rows, &s.send_rows)?);
        // Shared experts.
        self.shared_forward(be, p, x, s, n)?;
        s.gate = match self.gate {
            Some(g) => self
                .project(be, x, g.view::<B>(p), n, 1)?
                .into_iter()
                .map(sigmoid)
                .collect(),
            None => Vec::new(),
        };
        let Some(mut out) = out else {
            return Ok(());
        };
        be.fill(B::rb(&mut out), 0.0)?;
        let (to, from) = self.kept_slots(s, n);
        let w: Vec<f32> = from
            .iter()
            .map(|&row| s.routing.weights[s.order[row]])
            .collect();
        be.scatter_add_rows(
            B::rb(&mut out),
            kept::<B>(&s.y_back, sent * c)?,
            &to,
            &from,
            &w,
            c,
        )?;
        if !self.shared.is_empty() {
            let all: Vec<usize> = (0..n).collect();
            let g: Vec<f32> = (0..n)
                .map(|t| s.gate.get(t).copied().unwrap_or(1.0))
                .collect();
            be.scatter_add_rows(out, kept::<B>(&s.sh, n * c)?, &all, &all, &g, c)?;
        }
        Ok(())
    }

    /// `(n, m)` host values of `x (n, C) · w (m, C)ᵀ`, a GEMM on the backend (the router's
    /// logits, the gate's pre-activation).
    fn project<B: Backend>(
        &self,
        be: &B,
        x: B::Ref<'_>,
        w: B::Ref<'_>,
        n: usize,
        m: usize,
    ) -> Result<Vec<f32>, LayerError> {
        let mut z = be.alloc(Storage::F32, (n * m).max(1))?;
        be.matmul_bt(head_mut::<B>(&mut z, n * m), x, w, n, self.c, m, false)?;
        Ok(be.download(head::<B>(&z, n * m))?)
    }

    /// The shared experts' summed partial output into `s.sh`, their activations into `s`.
    fn shared_forward<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        x: B::Ref<'_>,
        s: &mut MoeSaved<B>,
        n: usize,
    ) -> Result<(), LayerError> {
        let c = self.c;
        let mut sh = grow(be, &mut s.sh, n * c)?;
        be.fill(B::rb(&mut sh), 0.0)?;
        s.shared_h.resize_with(self.shared.len(), || None);
        s.shared_a.resize_with(self.shared.len(), || None);
        let mut ys = fresh(be, n * c)?;
        for (i, mlp) in self.shared.iter().enumerate() {
            let h = grow(be, &mut s.shared_h[i], n * mlp.h_width())?;
            let mut a = grow(be, &mut s.shared_a[i], n * mlp.f_local)?;
            mlp.forward_hidden(be, p, x, h, B::rb(&mut a))?;
            let mut y = head_mut::<B>(&mut ys, n * c);
            mlp.proj.forward_partial(be, p, B::ro(&a), B::rb(&mut y))?;
            if self.lead() {
                mlp.proj.add_bias(be, p, B::rb(&mut y))?;
            }
            be.add_assign(B::rb(&mut sh), B::freeze(y))?;
        }
        Ok(())
    }

    /// The kept slots in token-then-slot order: each one's token and its row in `order`.
    fn kept_slots<B: Backend>(&self, s: &MoeSaved<B>, n: usize) -> (Vec<usize>, Vec<usize>) {
        let k = self.spec.top_k;
        (0..n * k)
            .filter(|&slot| s.pos[slot] != usize::MAX)
            .map(|slot| (slot / k, s.pos[slot]))
            .unzip()
    }

    /// A fresh buffer of `src`'s rows `rows[i]`, in that order (expert-major from received,
    /// or back).
    fn reorder<B: Backend>(
        &self,
        be: &B,
        src: &B::Buf,
        rows: &[usize],
    ) -> Result<B::Buf, LayerError> {
        let len = rows.len() * self.c;
        let mut out = fresh(be, len)?;
        let v = head::<B>(src, len);
        be.gather_rows(head_mut::<B>(&mut out, len), v, rows, None, self.c)?;
        Ok(out)
    }

    /// The routed experts' `h` and `a` widths.
    fn widths(&self) -> (usize, usize) {
        self.experts
            .first()
            .map_or((0, 0), |m| (m.h_width(), m.f_local))
    }

    /// Rows of `c` values: `send_rows[p]` of `data` to EP rank `p`, `recv_rows[p]` back from
    /// it, through the EP group's all-to-all on the backend's buffers. One rank: `data` is
    /// what it receives.
    fn exchange<B: Backend>(
        &self,
        be: &B,
        ws: &MoeWorkspace<B>,
        data: B::Buf,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<B::Buf, LayerError> {
        let Some(comm) = &ws.ep else {
            return Ok(data);
        };
        let c = self.c;
        let sc: Vec<usize> = send_rows.iter().map(|r| r * c).collect();
        let rc: Vec<usize> = recv_rows.iter().map(|r| r * c).collect();
        let (sent, got) = (sc.iter().sum(), rc.iter().sum());
        let mut out = fresh(be, got)?;
        comm.all_to_all_v(
            head::<B>(&data, sent),
            &sc,
            head_mut::<B>(&mut out, got),
            &rc,
        )?;
        Ok(out)
    }

    /// Given `dout (n, C)`, overwrites `dx (n, C)` with this TP rank's partial input gradient and
    /// accumulates parameter gradients into `g`; `tp_sum` sums a host vector over the TP group.
    pub fn backward<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        mut g: B::Mut<'_>,
        x: B::Ref<'_>,
        s: &MoeSaved<B>,
        dout: B::Ref<'_>,
        mut dx: B::Mut<'_>,
        ws: &mut MoeWorkspace<B>,
        tp_sum: &mut dyn FnMut(&mut [f32]) -> Result<(), LayerError>,
    ) -> Result<(), LayerError> {
        let (c, e, k) = (self.c, self.spec.experts, self.spec.top_k);
        let n = B::len(x) / c;
        let sent = s.order.len();
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
        // The combine weights' and the gate's gradients need the TP-summed outputs: a few
        // numbers per token, on the host.
        let gated = self.gate.is_some();
        let dout_h = be.download(dout)?;
        let y_back = be.download(kept::<B>(&s.y_back, sent * c)?)?;
        let sh = match gated {
            true => be.download(kept::<B>(&s.sh, n * c)?)?,
            false => Vec::new(),
        };
        let mut d = vec![0.0f32; n * k + if gated { n } else { 0 }];
        for t in 0..n {
            let dt = &dout_h[t * c..(t + 1) * c];
            for j in 0..k {
                let row = s.pos[t * k + j];
                if row != usize::MAX {
                    d[t * k + j] = dot(dt, &y_back[row * c..(row + 1) * c]);
                }
            }
            if gated {
                d[n * k + t] = dot(dt, &sh[t * c..(t + 1) * c]);
            }
        }
        tp_sum(&mut d)?;
        let (dweights, dgate) = d.split_at(n * k);
        // The experts' output gradients go where their rows came from.
        let tokens_of: Vec<usize> = s.order.iter().map(|&slot| slot / k).collect();
        let w: Vec<f32> = s
            .order
            .iter()
            .map(|&slot| s.routing.weights[slot])
            .collect();
        let mut dy = fresh(be, sent * c)?;
        be.gather_rows(
            head_mut::<B>(&mut dy, sent * c),
            dout,
            &tokens_of,
            Some(&w),
            c,
        )?;
        let recv = self.exchange(be, ws, dy, &s.send_rows, &s.recv_rows)?;
        let rows = s.perm.len();
        let dye = self.reorder(be, &recv, &s.perm)?;
        let (hw, fl) = self.widths();
        let mut dxe = fresh(be, rows * c)?;
        // Frozen experts sit past the gradient buffer, and their linears write no gradient.
        let pe = B::sub(p, self.expert_base..B::len(p));
        {
            let mut ge = match self.frozen {
                true => B::sub_mut(B::rb(&mut g), 0..0),
                false => B::split_at_mut(B::rb(&mut g), self.expert_base).1,
            };
            let (xin, h, a) = (
                kept::<B>(&s.xin, rows * c)?,
                kept::<B>(&s.h, rows * hw)?,
                kept::<B>(&s.a, rows * fl)?,
            );
            for (mlp, r) in self.experts.iter().zip(&s.expert_rows) {
                if r.is_empty() {
                    continue;
                }
                let ne = r.len();
                let (mut dh, mut da) = (fresh(be, ne * hw)?, fresh(be, ne * fl)?);
                mlp.backward_partial(
                    be,
                    pe,
                    B::rb(&mut ge),
                    B::sub(xin, r.start * c..r.end * c),
                    B::sub(h, r.start * hw..r.end * hw),
                    B::sub(a, r.start * fl..r.end * fl),
                    B::sub(B::view(&dye), r.start * c..r.end * c),
                    B::sub_mut(B::view_mut(&mut dxe), r.start * c..r.end * c),
                    head_mut::<B>(&mut dh, ne * hw),
                    head_mut::<B>(&mut da, ne * fl),
                )?;
            }
        }
        let back = self.reorder(be, &dxe, &s.unperm)?;
        let dx_back = self.exchange(be, ws, back, &s.recv_rows, &s.send_rows)?;
        be.fill(B::rb(&mut dx), 0.0)?;
        let (to, from) = self.kept_slots(s, n);
        let ones = vec![1.0f32; to.len()];
        be.scatter_add_rows(
            B::rb(&mut dx),
            head::<B>(&dx_back, sent * c),
            &to,
            &from,
            &ones,
            c,
        )?;
        // Shared experts (and their gate).
        if !self.shared.is_empty() {
            let mut dsh = fresh(be, n * c)?;
            let all: Vec<usize> = (0..n).collect();
            let scale = gated.then_some(&s.gate[..]);
            be.gather_rows(head_mut::<B>(&mut dsh, n * c), dout, &all, scale, c)?;
            let mut dxs = fresh(be, n * c)?;
            for (i, mlp) in self.shared.iter().enumerate() {
                let (hw, fl) = (mlp.h_width(), mlp.f_local);
                let (mut dh, mut da) = (fresh(be, n * hw)?, fresh(be, n * fl)?);
                mlp.backward_partial(
                    be,
                    p,
                    B::rb(&mut g),
                    x,
                    kept::<B>(&s.shared_h[i], n * hw)?,
                    kept::<B>(&s.shared_a[i], n * fl)?,
                    head::<B>(&dsh, n * c),
                    head_mut::<B>(&mut dxs, n * c),
                    head_mut::<B>(&mut dh, n * hw),
                    head_mut::<B>(&mut da, n * fl),
                )?;
                be.add_assign(B::rb(&mut dx), head::<B>(&dxs, n * c))?;
            }
        }
        if let Some(gw) = self.gate {
            let dz: Vec<f32> = (0..n)
                .map(|t| dgate[t] * s.gate[t] * (1.0 - s.gate[t]))
                .collect();
            self.project_backward(be, p, B::rb(&mut g), x, B::rb(&mut dx), &dz, gw, 1)?;
        }
        // The router: the combine weights and the load-balancing loss.
        let dprob: Option<Vec<f32>> = (self.aux_coef > 0.0 && self.aux_scale > 0.0).then(|| {
            let (kk, t) = (k as f64, s.tokens as f64);
            let w = self.aux_scale * self.aux_coef * e as f64 / (kk * t * t);
            s.counts
                .iter()
                .map(|&cnt| (w * f64::from(cnt)) as f32)
                .collect()
        });
        let mut dlogits = vec![0.0f32; n * e];
        self.spec
            .backward(&s.routing, dweights, dprob.as_deref(), &mut dlogits);
        self.project_backward(be, p, g, x, dx, &dlogits, self.router, e)
    }

    /// The backward of [`project`](Self::project) from host `dz (n, m)`: `w`'s gradient (unless
    /// frozen) and, on the lead TP rank, `dx += dz · w`.
    fn project_backward<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        g: B::Mut<'_>,
        x: B::Ref<'_>,
        dx: B::Mut<'_>,
        dz: &[f32],
        w: crate::params::ParamRef,
        m: usize,
    ) -> Result<(), LayerError> {
        let (n, c) = (dz.len() / m, self.c);
        let dz = upload(be, dz)?;
        let dz = head::<B>(&dz, n * m);
        if !self.frozen {
            be.matmul_at(w.view_mut::<B>(g), dz, x, m, n, c, true)?;
        }
        if self.lead() {
            be.matmul(dx, dz, w.view::<B>(p), n, m, c, true)?;
        }
        Ok(())
    }
}
