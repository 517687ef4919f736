//! `partition::balance` against an integer program solved by good_lp (microlp, pure Rust), on
//! instances far beyond brute force: up to 32 stages and 400 layers, with uneven per-stage
//! layer times (devices of different speed), embedding/head extras and memory caps.
//!
//! The MILP is the problem as written: integers `1 ≤ n_s ≤ cap_s` with `Σ n_s = L`, and
//! minimise `T` subject to `T ≥ n_s · t_s + e_s`. It shares no code with the bisection.

use good_lp::{
    constraint, default_solver, variable, Expression, ProblemVariables, Solution, SolverModel,
};
use tessera_planner::partition::{balance, Problem};

fn lcg(seed: &mut u64) -> f64 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (*seed >> 11) as f64 / (1u64 << 53) as f64
}

/// The optimal bottleneck by MILP, or `None` when the program is infeasible.
fn milp(p: &Problem) -> Option<f64> {
    let mut vars = ProblemVariables::new();
    let stages = p.layer_time.len();
    let n: Vec<_> = (0..stages)
        .map(|s| vars.add(variable().integer().min(1).max(p.max_layers[s] as f64)))
        .collect();
    let t = vars.add(variable().min(0.0));
    let mut model = vars.minimise(t).using(default_solver);
    let total: Expression = n.iter().copied().sum();
    model = model.with(constraint!(total == p.layers as f64));
    for ((&ns, &ts), &es) in n.iter().zip(&p.layer_time).zip(&p.extra_time) {
        model = model.with(constraint!(t >= ts * ns + es));
    }
    let solution = model.solve().ok()?;
    // Report the bottleneck of the integer split the solver chose, rounded to integers.
    let split: Vec<u64> = n
        .iter()
        .map(|v| solution.value(*v).round() as u64)
        .collect();
    assert_eq!(split.iter().sum::<u64>(), p.layers, "MILP split {split:?}");
    Some(p.bottleneck(&split))
}

#[test]
fn balance_equals_the_milp_optimum_on_large_instances() {
    let mut seed = 2024;
    let mut solved = 0;
    for case in 0..60 {
        let stages = 2 + case % 31;
        let layers = stages as u64 + (lcg(&mut seed) * 12.0 * stages as f64) as u64;
        let mut extra = vec![0.0; stages];
        extra[0] = 3.0 * lcg(&mut seed);
        extra[stages - 1] = 6.0 * lcg(&mut seed);
        let p = Problem {
            layers,
            layer_time: (0..stages).map(|_| 0.5 + lcg(&mut seed)).collect(),
            extra_time: extra,
            max_layers: (0..stages)
                .map(|_| 1 + (lcg(&mut seed) * 20.0) as u64)
                .collect(),
        };
        match (balance(&p), milp(&p)) {
            (None, None) => {}
            (Some(split), Some(want)) => {
                solved += 1;
                let got = p.bottleneck(&split);
                assert!(
                    (got - want).abs() <= 1e-6 * want,
                    "case {case}: balance {got} ({split:?}), MILP {want}; {p:?}"
                );
            }
            (got, want) => panic!("case {case}: balance {got:?}, MILP {want:?}; {p:?}"),
        }
    }
    // The instances are meant to be mostly feasible; a generator that made them all
    // infeasible would test nothing.
    assert!(solved >= 30, "only {solved} feasible instances");
}
