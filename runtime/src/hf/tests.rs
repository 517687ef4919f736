use tessera_planner::model::{Activation, Norm, Position};

use super::*;

fn tiny(llama: bool) -> Architecture {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs/models/tiny.toml");
    let mut a = tessera_planner::spec::load_model(&path, Default::default())
        .unwrap()
        .architecture;
    if llama {
        a.position = Position::Rope;
        a.norm = Norm::Rmsnorm;
        a.activation = Activation::Swiglu;
        a.bias = false;
        a.qkv_bias = false;
        a.max_positions = 0;
    }
    a
}

#[test]
fn families_follow_the_architecture_and_refusals_name_the_field() {
    assert_eq!(family(&tiny(false)).unwrap(), Family::Gpt2);
    assert_eq!(family(&tiny(true)).unwrap(), Family::Llama);
    type Edit = fn(&mut Architecture);
    let cases: [(bool, Edit, &str); 4] = [
        (
            false,
            |a| a.tied_embeddings = false,
            "model.tied_embeddings",
        ),
        (false, |a| a.norm = Norm::Rmsnorm, "model.norm"),
        (true, |a| a.bias = true, "model.bias"),
        (true, |a| a.qkv_bias = true, "model.qkv_bias"),
    ];
    for (llama, edit, field) in cases {
        let mut a = tiny(llama);
        edit(&mut a);
        let e = family(&a).unwrap_err().to_string();
        assert!(e.starts_with(field), "{e}");
    }
}

#[test]
fn gpt2_fuses_qkv_and_stores_conv1d_weights_transposed() {
    let a = tiny(false);
    let m = mapping(&a, Family::Gpt2);
    let c_attn = m
        .iter()
        .find(|m| m.hf == "transformer.h.0.attn.c_attn.weight")
        .unwrap();
    assert!(c_attn.conv1d);
    assert_eq!(
        c_attn.ours,
        [
            "h.0.attn.q.weight",
            "h.0.attn.k.weight",
            "h.0.attn.v.weight"
        ]
    );
    assert!(
        !m.iter().any(|m| m.hf == "lm_head.weight"),
        "tied: not stored"
    );
    assert_eq!(
        export::transpose(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2, 3),
        [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]
    );
}
