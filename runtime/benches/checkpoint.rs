//! Checkpoint save and load time, and bytes on disk, for GPT-2 124M on 1 rank and on 8 ranks
//! (DP 2 × PP 2 × TP 2, ZeRO-1, 1F1B, no SP: the layout `tessera plan` picks for these pins on
//! specs/clusters/cpu-8.toml).
//!
//! Each plan trains one step with a save (`train` with `SaveOptions`, the runtime's own save
//! path), so the state is real: f32 master weights and non-zero Adam moments of all 124M
//! parameters. The training is cut to sequence 64 and global batch 8 (the preset's 1024 × 512
//! would take hours on a CPU); a checkpoint holds parameters and moments only, so its size does
//! not depend on the batch. Then, `REPS` times each, with the minimum and the median printed:
//!
//! - save: every rank's `Saver::submit` on its own thread, as the rank threads of a run call
//!   it, from the first call to the last return: the shard files (serialised by the safetensors
//!   crate, fsynced), `index.json`, the directory fsync, the rename to `step-N` and the `latest`
//!   pointer. Each repetition saves into a fresh directory (removed after, outside the timing).
//!   The shards are rebuilt from the trained checkpoint as `Rank::save` builds them (the same
//!   `owned_pieces`), and the first repetition's files are checked against the files the run
//!   wrote (`same_file`: the tensor data byte for byte). Not timed: copying the rank's buffers
//!   into the shard (a memcpy here).
//! - bytes: the shard files and the index of one checkpoint.
//! - open: `Checkpoint::open`, which reads every shard and checks it against the index (length,
//!   checksum where the index records one, tensors, coverage), once with the files in the page cache (just written) and once after
//!   evicting them with `posix_fadvise(DONTNEED)` (the VM's host may still cache the disk).
//! - restore: `Checkpoint::restore` for every rank of a plan, one thread per rank as a resumed
//!   run does, onto the same plan and onto the other one (1 ↔ 8 ranks: resharding).
//!
//! Run: `cargo bench -p tessera-runtime --bench checkpoint` (docs/checkpoints.md records a run,
//! with the machine and the date). Writes about 3 GB at a time under the target directory.

use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Instant;

use tessera_planner::layout::{Layout, Recompute};
use tessera_planner::plan::{Plan, SearchSummary};
use tessera_planner::schedule::ScheduleKind;
use tessera_planner::spec::{load_cluster, load_model, ClusterOverrides, TrainingOverrides};
use tessera_planner::Mesh;
use tessera_runtime::checkpoint::{
    owned_pieces, step_dir_name, Checkpoint, Piece, RankShard, SaveOptions, Saver, INDEX,
};
use tessera_runtime::data::Tokens;
use tessera_runtime::exec::{shard_of, train, StageModel, TrainOptions};
use tessera_runtime::layers::tp::TpShard;
use tessera_runtime::params::ParamLayout;

const SEQ: u64 = 64;
const GLOBAL_BATCH: u64 = 8;
const REPS: usize = 5;
/// The step the checkpoints hold: one trained step.
const STEP: usize = 1;

/// One rank of a plan: what its save and its restore need.
struct RankPart {
    rank: usize,
    dp: u64,
    tp: u64,
    pp: u64,
    layout: ParamLayout,
    /// Its optimizer ranges (the whole buffer under ZeRO-0, its DP shard of each chunk else).
    ranges: Vec<Range<usize>>,
    /// Whether it writes its optimizer ranges (ZeRO > 0, or DP rank 0).
    writes: bool,
    tied_copy: Option<Range<usize>>,
}

struct Setup {
    name: &'static str,
    plan: Plan,
    parts: Vec<RankPart>,
}

fn plan(layout: &Layout) -> Plan {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let over = TrainingOverrides {
        seq_len: Some(SEQ),
        global_batch: Some(GLOBAL_BATCH),
        ..Default::default()
    };
    let model = load_model(&root.join("specs/models/gpt2-124m.toml"), over).expect("preset loads");
    let cluster = load_cluster(
        &root.join("specs/clusters/cpu-8.toml"),
        ClusterOverrides {
            nodes: None,
            devices: Some(layout.dp * layout.cp * layout.pp * layout.tp),
        },
    )
    .expect("preset loads");
    Plan::new(&model, &cluster, layout, SearchSummary::pinned())
}

/// Every rank's layout and optimizer ranges, built as `Rank::new` builds them.
fn setup(name: &'static str, plan: Plan) -> Setup {
    let p = &plan.parallel;
    let mesh = Mesh::with_cp(p.dp, p.cp, p.pp, p.tp, plan.job.cluster.gpus_per_node);
    let parts = (0..mesh.world())
        .map(|r| {
            let c = mesh.coord(r);
            let tp = TpShard::new(c.tp as usize, p.tp as usize);
            let model = StageModel::build(&plan, c.pp as usize, tp).expect("the stage builds");
            let ranges = if p.zero_stage == 0 {
                std::iter::once(0..model.layout.len()).collect()
            } else {
                model
                    .chunks
                    .iter()
                    // ZeRO shards over DP × CP, in (dp, cp) order (`Mesh::dp_cp_group`).
                    .map(|ch| {
                        let (n, at) = (p.dp * p.cp, c.dp * p.cp + c.cp);
                        shard_of(&ch.region, n as usize, at as usize)
                    })
                    .collect()
            };
            RankPart {
                rank: r as usize,
                dp: c.dp,
                tp: c.tp,
                pp: c.pp,
                layout: model.layout,
                ranges,
                writes: p.zero_stage > 0 || c.dp == 0,
                tied_copy: model.tied_copy,
            }
        })
        .collect();
    Setup { name, plan, parts }
}

/// Rank `part`'s shard as `Rank::save` hands it over, from a checkpoint of the same plan.
fn shard(ck: &Checkpoint, part: &RankPart) -> RankShard {
    let state = ck.restore(&part.layout, &part.ranges).expect("restores");
    let mut pieces = Vec::new();
    for (range, (m, v)) in part
        .ranges
        .iter()
        .zip(&state.moments)
        .filter(|_| part.writes)
    {
        let owned = owned_pieces(
            &part.layout,
            std::slice::from_ref(range),
            part.tp as usize,
            part.tied_copy.as_ref(),
        );
        for (sub, meta) in owned {
            let rel = sub.start - range.start..sub.end - range.start;
            pieces.push(Piece {
                meta,
                param: state.params[sub].to_vec(),
                exp_avg: m[rel.clone()].to_vec(),
                exp_avg_sq: v[rel].to_vec(),
            });
        }
    }
    RankShard {
        rank: part.rank,
        dp: part.dp,
        tp: part.tp,
        pp: part.pp,
        optimizer_ranges: part.ranges.clone(),
        pieces,
    }
}

/// (min, median) of `xs`.
fn stats(xs: &mut [f64]) -> (f64, f64) {
    xs.sort_by(|a, b| a.total_cmp(b));
    let n = xs.len();
    let median = if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    };
    (xs[0], median)
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = fs::read_dir(dir)
        .expect("lists the checkpoint")
        .map(|e| e.expect("an entry").path())
        .collect();
    out.sort();
    out
}

/// Whether two files hold the same bytes, a safetensors header compared as JSON, an index as
/// JSON without the shards' `sha256` (where the index has one).
fn same_file(a: &[u8], b: &[u8]) -> bool {
    let split = |x: &[u8]| -> Option<(serde_json::Value, usize)> {
        let n = u64::from_le_bytes(x.get(..8)?.try_into().ok()?) as usize;
        Some((serde_json::from_slice(x.get(8..8 + n)?).ok()?, 8 + n))
    };
    // An index: equal but for the shards' SHA-256, which differ where the headers' order does.
    let index = |x: &[u8]| -> Option<serde_json::Value> {
        let mut v: serde_json::Value = serde_json::from_slice(x).ok()?;
        for shard in v.get_mut("shards")?.as_array_mut()? {
            shard.as_object_mut()?.remove("sha256");
        }
        Some(v)
    };
    match (split(a), split(b)) {
        (Some((ha, na)), Some((hb, nb))) => ha == hb && a[na..] == b[nb..],
        _ => match (index(a), index(b)) {
            (Some(ia), Some(ib)) => ia == ib,
            _ => a == b,
        },
    }
}

/// Drops `dir`'s files from the page cache (they are fsynced, so their pages are clean).
fn evict(dir: &Path) {
    use std::os::fd::AsRawFd;
    for f in files(dir) {
        let file = fs::File::open(&f).expect("opens");
        // SAFETY: a valid open descriptor; the call only advises the kernel.
        let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(rc, 0, "posix_fadvise {}", f.display());
    }
}

/// Seconds that `f` takes.
fn time<T>(f: impl FnOnce() -> T) -> (f64, T) {
    let start = Instant::now();
    let out = f();
    (start.elapsed().as_secs_f64(), out)
}

fn restore_all(ck: &Checkpoint, onto: &Setup) -> f64 {
    let (s, states) = time(|| {
        std::thread::scope(|sc| {
            let hs: Vec<_> = onto
                .parts
                .iter()
                .map(|p| sc.spawn(move || ck.restore(&p.layout, &p.ranges).expect("restores")))
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("restore thread"))
                .collect::<Vec<_>>()
        })
    });
    drop(states);
    s
}

fn fmt((min, median): (f64, f64)) -> String {
    format!("{min:.3} / {median:.3}")
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let data = Tokens::load(&root.join("examples/data/parallelism.txt")).expect("bundled text");
    let work = Path::new(env!("CARGO_TARGET_TMPDIR")).join("checkpoint-bench");
    fs::remove_dir_all(&work).ok();
    fs::create_dir_all(&work).expect("creates the work directory");

    let one = Layout::without_pipeline(1, 1, 0, 4);
    let eight = Layout {
        pp: 2,
        recompute: Recompute::None,
        schedule: ScheduleKind::OneFOneB,
        ..Layout::without_pipeline(2, 2, 1, 2)
    };
    let setups = [
        setup("1 rank", plan(&one)),
        setup("8 ranks (DP 2 × PP 2 × TP 2, ZeRO-1)", plan(&eight)),
    ];
    let opts = TrainOptions {
        steps: STEP,
        ..TrainOptions::default()
    };
    println!(
        "GPT-2 124M, sequence {SEQ}, global batch {GLOBAL_BATCH}, {STEP} trained step; {REPS} repetitions, min / median"
    );

    // Train one step on each plan, saving through the run (the reference files).
    let mut trained = Vec::new();
    for s in &setups {
        let dir = work.join(format!("trained-{}", s.parts.len()));
        let o = TrainOptions {
            save: Some(SaveOptions {
                dir: dir.clone(),
                every: 1,
                keep: None,
                lineage: None,
            }),
            ..opts.clone()
        };
        let (secs, report) = time(|| train(&s.plan, &data, &o, &mut |_| {}).expect("trains"));
        println!(
            "{}: trained {STEP} step in {secs:.1} s (loss {:.4}), saved to {}",
            s.name,
            report.steps[0].loss,
            dir.display()
        );
        trained.push(dir.join(step_dir_name(STEP)));
    }

    struct Row {
        files: usize,
        bytes: u64,
        save: (f64, f64),
        open_warm: (f64, f64),
        open_cold: (f64, f64),
    }
    let mut rows = Vec::new();
    for (s, reference) in setups.iter().zip(&trained) {
        let ck = Checkpoint::open(reference).expect("opens");
        let shards: Vec<RankShard> = s.parts.iter().map(|p| shard(&ck, p)).collect();
        let updates = ck.index().optimizer.updates;
        drop(ck);
        let adam = opts.adamw(&s.plan);
        let schedule = opts.lr_schedule(&s.plan);
        let mut saves = Vec::new();
        let mut kept = None;
        for rep in 0..REPS {
            let dir = work.join(format!("save-{}-{rep}", s.parts.len()));
            let save = SaveOptions {
                dir: dir.clone(),
                every: 1,
                keep: None,
                lineage: None,
            };
            let seeds = (opts.seed, opts.seed);
            let saver = Saver::new(
                &save,
                &s.plan,
                &data,
                seeds,
                schedule,
                adam,
                opts.clip(&s.plan),
            )
            .expect("a saver");
            let copies = shards.clone();
            let (secs, ()) = time(|| {
                std::thread::scope(|sc| {
                    for sh in copies {
                        let saver = &saver;
                        sc.spawn(move || saver.submit(STEP, updates, sh).expect("saves"));
                    }
                })
            });
            saves.push(secs);
            let made = dir.join(step_dir_name(STEP));
            if rep == 0 {
                // The bench's shards are the run's: every file equal, byte for byte (a shard's
                // header as JSON: its metadata map's order varies from one save to the next).
                for f in files(reference) {
                    let name = f.file_name().expect("a name");
                    let ours = fs::read(made.join(name)).expect("reads");
                    assert!(
                        same_file(&ours, &fs::read(&f).expect("reads")),
                        "{} differs from the run's save",
                        name.to_string_lossy()
                    );
                }
                kept = Some(made);
            } else {
                fs::remove_dir_all(&dir).expect("removes");
            }
        }
        drop(shards);
        let made = kept.expect("the first save");
        let on_disk = files(&made);
        let bytes: u64 = on_disk
            .iter()
            .map(|f| f.metadata().expect("stat").len())
            .sum();
        let shard_files = on_disk.iter().filter(|f| !f.ends_with(INDEX)).count();
        let (mut warm, mut cold) = (Vec::new(), Vec::new());
        for _ in 0..REPS {
            let (secs, ck) = time(|| Checkpoint::open(&made).expect("opens"));
            drop(ck);
            warm.push(secs);
            evict(&made);
            let (secs, ck) = time(|| Checkpoint::open(&made).expect("opens"));
            drop(ck);
            cold.push(secs);
        }
        rows.push(Row {
            files: shard_files,
            bytes,
            save: stats(&mut saves),
            open_warm: stats(&mut warm),
            open_cold: stats(&mut cold),
        });
    }

    // Restore: each checkpoint onto each plan.
    let mut restores = Vec::new();
    for (from, dir) in setups.iter().zip(&trained) {
        let ck = Checkpoint::open(dir).expect("opens");
        for onto in &setups {
            let mut xs: Vec<f64> = (0..REPS).map(|_| restore_all(&ck, onto)).collect();
            restores.push((from.name, onto.name, stats(&mut xs)));
        }
    }
    fs::remove_dir_all(&work).ok();

    println!();
    println!("| plan | shard files | bytes on disk (shards + index) | save s | save GB/s (median) | open s, page cache warm | open s, files evicted |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for (s, r) in setups.iter().zip(&rows) {
        println!(
            "| {} | {} | {} ({:.3} GiB) | {} | {:.2} | {} | {} |",
            s.name,
            r.files,
            r.bytes,
            r.bytes as f64 / (1u64 << 30) as f64,
            fmt(r.save),
            r.bytes as f64 / r.save.1 / 1e9,
            fmt(r.open_warm),
            fmt(r.open_cold)
        );
    }
    let ratio = |f: &dyn Fn(&Row) -> f64| f(&rows[1]) / f(&rows[0]);
    println!(
        "| 8 ranks / 1 rank (medians) | | {:.4} | {:.2} | | {:.2} | {:.2} |",
        ratio(&|r| r.bytes as f64),
        ratio(&|r| r.save.1),
        ratio(&|r| r.open_warm.1),
        ratio(&|r| r.open_cold.1)
    );
    println!();
    println!("| checkpoint of | restored onto | restore s (every rank, one thread each) |");
    println!("|---|---|---:|");
    for (from, onto, st) in &restores {
        println!("| {from} | {onto} | {} |", fmt(*st));
    }
}
