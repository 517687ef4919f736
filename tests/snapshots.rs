//! Plan snapshots of preset pairs: a planner change shows up here as a reviewed diff.
//!
//! Record new snapshots with `INSTA_UPDATE=always cargo test --test snapshots` (or
//! `cargo insta test --accept`), then review them with `git diff`.

use std::process::Command;

fn plan(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .arg("plan")
        .args(args)
        .output()
        .expect("tessera runs");
    assert!(
        out.status.success(),
        "tessera plan {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

macro_rules! snapshot {
    ($name:ident, $($arg:expr),+) => {
        #[test]
        fn $name() {
            let args = [$($arg),+];
            insta::with_settings!({ description => format!("tessera plan {}", args.join(" ")), omit_expression => true }, {
                insta::assert_snapshot!(plan(&args));
            });
        }
    };
}

snapshot!(
    gpt3_175b_on_128_dgx_a100,
    "specs/models/gpt3-175b.toml",
    "specs/clusters/dgx-a100-80g.toml",
    "--nodes",
    "128",
    "--top",
    "5"
);
snapshot!(
    llama3_70b_on_8_dgx_h100,
    "specs/models/llama3-70b.toml",
    "specs/clusters/dgx-h100-80g.toml",
    "--nodes",
    "8",
    "--top",
    "5"
);
snapshot!(
    llama3_1_405b_on_2048_dgx_h100,
    "specs/models/llama3.1-405b.toml",
    "specs/clusters/dgx-h100-80g.toml",
    "--nodes",
    "2048",
    "--top",
    "5"
);
snapshot!(
    tiny_on_cpu_8,
    "specs/models/tiny.toml",
    "specs/clusters/cpu-8.toml",
    "--top",
    "5"
);
snapshot!(
    gpt2_124m_on_one_dgx_a100,
    "specs/models/gpt2-124m.toml",
    "specs/clusters/dgx-a100-80g.toml",
    "--top",
    "5"
);
snapshot!(
    llama3_8b_on_one_dgx_h100,
    "specs/models/llama3-8b.toml",
    "specs/clusters/dgx-h100-80g.toml",
    "--top",
    "5"
);
snapshot!(
    megatron_1t_on_384_dgx_a100,
    "specs/models/megatron-1t.toml",
    "specs/clusters/dgx-a100-80g.toml",
    "--nodes",
    "384",
    "--top",
    "5"
);
snapshot!(
    megatron_530b_on_315_dgx_a100,
    "specs/models/megatron-530b.toml",
    "specs/clusters/dgx-a100-80g.toml",
    "--nodes",
    "315",
    "--top",
    "5"
);
snapshot!(
    llama3_8b_on_4_h100s,
    "specs/models/llama3-8b.toml",
    "specs/clusters/dgx-h100-80g.toml",
    "--devices",
    "4",
    "--top",
    "5"
);
snapshot!(
    gpt3_175b_pinned_megatron_layout_json,
    "specs/models/gpt3-175b.toml",
    "specs/clusters/dgx-a100-80g.toml",
    "--nodes",
    "128",
    "--tp",
    "8",
    "--pp",
    "8",
    "--dp",
    "16",
    "--micro-batch",
    "1",
    "--recompute",
    "full",
    "--format",
    "json"
);
// Llama 3.1 405B at its published 8k layout (Dubey et al. 2024, Table 4 and §3.3.2): TP 8 ×
// PP 16 × DP 128, interleaved, the first and last stage one layer short, so that the first
// chunk holds only the embedding and the last only the output layer and loss.
snapshot!(
    llama3_1_405b_published_8k_layout,
    "specs/models/llama3.1-405b.toml",
    "specs/clusters/dgx-h100-80g.toml",
    "--nodes",
    "2048",
    "--tp",
    "8",
    "--pp",
    "16",
    "--dp",
    "128",
    "--schedule",
    "interleaved",
    "--virtual-stages",
    "8",
    "--first-stage-layers",
    "7",
    "--last-stage-layers",
    "7",
    "--top",
    "5"
);
// Llama 3.1 405B at 131,072 tokens on 16,384 H100s (Dubey et al. 2024, Table 4's long-context
// row: 16M tokens per step = 128 sequences): the search splits the sequence with context
// parallelism.
snapshot!(
    llama3_1_405b_131k_on_2048_dgx_h100,
    "specs/models/llama3.1-405b.toml",
    "specs/clusters/dgx-h100-80g.toml",
    "--nodes",
    "2048",
    "--seq-len",
    "131072",
    "--global-batch",
    "128",
    "--top",
    "5"
);
// Mixtral-8x7B on 64 H100s at the batch of Megatron-Core's MoE benchmark (global batch 256 ×
// 4096 tokens; docs/moe-figures.md row 3): the search picks EP with the rest.
snapshot!(
    mixtral_8x7b_on_8_dgx_h100,
    "specs/models/mixtral-8x7b.toml",
    "specs/clusters/dgx-h100-80g.toml",
    "--nodes",
    "8",
    "--seq-len",
    "4096",
    "--global-batch",
    "256",
    "--top",
    "5"
);
// DeepSeek-V3 on its own cluster, 2,048 H800s (arXiv 2412.19437 §3.1; the preset's 256 nodes),
// at its pre-training batch (15,360 × 4096): MLA, 256 routed experts and a shared one, the
// first three layers dense.
snapshot!(
    deepseek_v3_on_2048_h800,
    "specs/models/deepseek-v3.toml",
    "specs/clusters/h800-deepseek.toml",
    "--top",
    "5"
);
